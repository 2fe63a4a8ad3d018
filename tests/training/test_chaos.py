"""Chaos: a run that saves every step, killed by SIGKILL at random points again and again, ends bit-identical.

Each ``zinfjax train ... resume=true`` process is killed at a random moment while it trains: a
random delay, up to one step-and-save period of the uninterrupted run (and before the next save
begins), after the save of a random one of its next two steps begins. So the kill lands in a step,
in a save's background write, in its commit, or in the pruning of an old checkpoint. The next
process resumes from whatever the kill left. After ``kills`` kills a last process runs to the end,
and its checkpoints must equal, file for file and byte for byte (every chunk, with its crc32c),
those of a run that was never interrupted: invariant 4 (docs/design.md) under kills at any point.

make test kills a 6-step run twice (4 ``zinfjax train`` processes); the wide form, for make test-all,
kills a 10-step run 4 times (6 processes), the same seed's first two kill points and two more.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import pytest

from tests.support.train_runs import chunk_files as files
from tests.support.xla_flags import child_env
from zinfjax.checkpoint import complete_steps, read_meta
from zinfjax.checkpoint.verify import verify_save_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 18  # of the kill points: a failure reproduces with the same ones
SETTINGS = ["model=gpt2-tiny", "batch_size=2", "seq_len=16", "mesh=data:1", "save_every=1", "keep_checkpoints=2"]


def start(save_dir, steps: int, *settings) -> subprocess.Popen:
    """A ``zinfjax train`` process of ``steps`` steps; JAX's persistent compilation cache (beside ``save_dir``)
    spares the restarts most of their start-up, as it would a user's."""
    args = [a for s in [*SETTINGS, f"steps={steps}", f"save_dir={save_dir}", *settings] for a in ("--set", s)]
    env = {"JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.dirname(save_dir), "jax-cache"), **child_env(),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return subprocess.Popen([sys.executable, "-m", "zinfjax.cli", "train", "--quiet", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def reached(save_dir, step: int, phase: str) -> bool:
    """Whether the save of ``step`` has begun (``began``; it begins once the one before is committed) or is
    committed (``committed``; the pruning of the oldest checkpoint follows at once)."""
    names = [str(step)] if phase == "committed" else [f".tmp-{step}", str(step)]
    return any(os.path.exists(os.path.join(save_dir, name)) for name in names)


def wait_for(proc: subprocess.Popen, save_dir, step: int, phase: str = "began", timeout: float = 300) -> float | None:
    """The time the save of ``step`` reached ``phase`` in ``proc``, or None if ``proc`` finished before."""
    deadline = time.monotonic() + timeout
    conditions = [lambda: reached(save_dir, step, phase)]
    stale = os.path.join(save_dir, f".tmp-{step}")
    if os.path.exists(stale):  # a killed process's: first wait for this process's start to clear it
        conditions.insert(0, lambda: not os.path.exists(stale) or reached(save_dir, step, "committed"))
    for done in conditions:
        while not done():
            if proc.poll() is not None:
                assert proc.returncode == 0, proc.stderr.read()[-3000:]
                return None
            assert time.monotonic() < deadline, f"the save of step {step} never {phase}"
            time.sleep(0.002)
    return time.monotonic()


def step_period(proc: subprocess.Popen, save_dir, steps: int) -> float:
    """Runs ``proc`` (of ``steps`` steps) to its end; the median time between the beginnings of two saves."""
    began = [wait_for(proc, save_dir, step) for step in range(1, steps + 1)]
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    return statistics.median(b - a for a, b in zip(began, began[1:], strict=False))


@pytest.fixture
def root(tmp_path):
    """A directory on tmpfs where there is one (/dev/shm): ``syncfs`` there waits for no other process's writes,
    so the run's pace is its own; a SIGKILL leaves the page cache, and so the files, the same on any filesystem."""
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = tempfile.mkdtemp(prefix="zinfjax-chaos-", dir=shm)
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


# The last kill's step is at most 2 x kills, before the last step: the run never ends before it.
@pytest.mark.parametrize("kills,steps", [(2, 6), pytest.param(4, 10, marks=pytest.mark.wide)])
@pytest.mark.slow
def test_sigkill_at_random_points_ends_bit_identical_to_an_uninterrupted_run(root, kills, steps):
    assert 2 * kills < steps
    reference, chaos = root / "reference", root / "chaos"
    period = step_period(start(reference, steps), reference, steps)

    rng, killed = random.Random(SEED), 0
    while killed < kills:
        resumed = max(complete_steps(str(chaos)), default=0)
        target, phase = min(resumed + rng.choice([1, 2]), steps), rng.choice(["began", "committed"])
        proc = start(chaos, steps, "resume=true")
        assert wait_for(proc, chaos, target, phase) is not None, f"the run finished after {killed} kills"
        delay = rng.uniform(0.0, period)
        kill_at = time.monotonic() + delay
        # At the latest when the next save begins: a run faster than the reference's is still killed in its step.
        while time.monotonic() < kill_at and not reached(chaos, target + 1, "began"):
            time.sleep(0.002)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed += 1
        print(f"kill {killed}: resumed from step {resumed}, {delay:.2f} s after step {target}'s save {phase}; left "
              f"{sorted(os.listdir(chaos))}")
    proc = start(chaos, steps, "resume=true")
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]

    assert killed == kills
    assert complete_steps(str(chaos)) == complete_steps(str(reference)) == [steps - 1, steps]
    assert all(c.complete for c in verify_save_dir(str(chaos)))  # no partial step, no leftover
    for step in (steps - 1, steps):
        a, b = files(reference / str(step)), files(chaos / str(step))
        assert a.keys() == b.keys() and len(a) > 50
        assert [k for k in a if a[k] != b[k]] == []
        ma, mb = read_meta(str(reference / str(step))), read_meta(str(chaos / str(step)))
        assert (ma["items"], ma["data_position"], ma["loss_scale"]) == (mb["items"], mb["data_position"],
                                                                         mb["loss_scale"])
    assert len({read_meta(str(chaos / str(s)))["run_id"] for s in (steps - 1, steps)}) == 1  # one run throughout
