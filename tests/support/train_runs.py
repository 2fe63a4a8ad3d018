"""``zinfjax train`` runs in child processes for the fault tests: start one, finish it, read what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.xla_flags import child_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(settings: list[str], cache, save_dir, nvme_path, log, *extra: str) -> subprocess.Popen:
    """A quiet ``zinfjax train`` with ``settings`` and ``extra``, on one device with the tests' compile flags. A
    JAX compilation cache (the suite's where it has one, else ``cache``) spares the runs most of their start-up,
    as it would a user's."""
    args = [a for s in [*settings, f"save_dir={save_dir}", f"nvme_path={nvme_path}", f"log={log}", *extra]
            for a in ("--set", s)]
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), **child_env(), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return subprocess.Popen([sys.executable, "-m", "zinfjax.cli", "train", "--quiet", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> None:
    """Waits for ``proc``; it must succeed."""
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def losses(log) -> dict[int, float]:
    """Each step's loss in a run's JSON log."""
    with open(log) as f:
        return {r["step"]: r["loss"] for r in json.load(f)["steps"]}


def chunk_files(step_dir) -> dict[str, bytes]:
    """Every file of a checkpoint's params and opt_state (not its zinfjax.json, which holds times)."""
    out = {}
    for item in ("params", "opt_state"):
        for root, _, names in os.walk(os.path.join(step_dir, item)):
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    out[os.path.relpath(os.path.join(root, name), step_dir)] = f.read()
    return out


def verify_cli(save_dir) -> subprocess.CompletedProcess:
    """``zinfjax ckpt info --verify save_dir``."""
    return subprocess.run([sys.executable, "-m", "zinfjax.cli", "ckpt", "info", "--verify", str(save_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def the_error(returncode: int, err: str) -> str:
    """The one ``zinfjax: error:`` line of a run that stopped with status 2 and printed no traceback."""
    lines = err.strip().splitlines()
    errors = [line.removeprefix("zinfjax: error: ") for line in lines if line.startswith("zinfjax: error: ")]
    assert returncode == 2 and len(errors) == 1, err
    assert all(line.startswith("zinfjax: ") for line in lines), err  # warnings at most: no traceback
    return errors[0]
