"""Runs side by side: ``zinfjax train`` runs at once on one disk, each in its own 1 GiB memory cgroup.

Each run (gpt2-tiny, every tier on NVMe, its own ``nvme_path`` and ``save_dir``, its own seed) is a fresh
process inside its own cgroup v1 memory group (page cache included, `zinfjax.benchmarks.cgroup`). They
start together and overlap; each ends with exit status 0, no OOM kill, its usage never at the limit;
its losses and its final checkpoint's parameters are bit for bit those of the same run alone (the same
config in a cgroup of its own, one run at a time).

Run:
    $ .venv/bin/pytest -q -p no:xdist tests/training/test_side_by_side.py
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorstore as ts

from tests.support.xla_flags import child_env
from zinfjax.benchmarks.cgroup import MemoryCgroup
from zinfjax.checkpoint import read_meta

LIMIT = 1 << 30
STEPS = 3
SEEDS = (0, 1, 2)
NVME = ["model=gpt2-tiny", "params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme", "batch_size=4",
        f"steps={STEPS}"]


def _argv(root, seed: int) -> list[str]:
    run = root / f"seed{seed}"
    sets = [*NVME, f"seed={seed}", f"nvme_path={run / 'nvme'}", f"save_dir={run / 'ckpt'}", f"log={run / 'log.json'}"]
    return [sys.executable, "-m", "zinfjax.cli", "train", "--quiet", *(a for s in sets for a in ("--set", s))]


def _together(root, seeds) -> dict[int, dict]:
    """The runs of ``seeds`` started at once, each in its own cgroup; per run its exit status, the cgroup's
    figures, and when it started and was seen ended."""
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    with contextlib.ExitStack() as stack:
        groups = {s: stack.enter_context(MemoryCgroup(LIMIT)) for s in seeds}
        procs = {}
        for s in seeds:
            err = stack.enter_context(open(root / f"seed{s}.stderr", "w"))
            procs[s] = subprocess.Popen(groups[s].command(_argv(root, s)), env=child_env(), stdout=err, stderr=err)
            out[s] = {"started": time.monotonic()}
        deadline = time.monotonic() + 300
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            for s, p in procs.items():
                if p.poll() is not None and "ended" not in out[s]:
                    out[s]["ended"] = time.monotonic()
            time.sleep(0.05)
        for s, p in procs.items():
            if p.poll() is None:
                p.kill()
            out[s].update(exit=p.wait(), ended=out[s].get("ended", time.monotonic()),
                          oom_kills=groups[s].oom_kills(), max_usage=groups[s].max_usage_bytes(),
                          failcnt=_failcnt(groups[s]))
            out[s]["stderr"] = (root / f"seed{s}.stderr").read_text()[-2000:]
    return out


def _failcnt(group: MemoryCgroup) -> int:
    """How often the group's usage hit its limit (reclaim, page cache included; an OOM kill is counted apart)."""
    with open(os.path.join(group.path, "memory.failcnt")) as f:
        return int(f.read())


def _losses(root, seed: int) -> list[float]:
    with open(root / f"seed{seed}" / "log.json") as f:
        return [s["loss"] for s in json.load(f)["steps"]]


def _params(root, seed: int) -> dict[str, np.ndarray]:
    """The final checkpoint's parameters, every leaf read whole through tensorstore."""
    path = str(root / f"seed{seed}" / "ckpt" / str(STEPS))
    spec = lambda name: {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, "params", name)}}
    return {name: ts.open(spec(name), open=True, read=True).result().read().result()
            for name in read_meta(path)["items"]["params"]}


def _assert_ran(run: dict) -> None:
    assert run["exit"] == 0 and run["oom_kills"] == 0, run
    assert run["max_usage"] < LIMIT and run["failcnt"] == 0, run  # never at its limit


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), f"{name} differs"


# make test runs two at once; make test-all three.
@pytest.mark.parametrize("seeds", [SEEDS[:2], pytest.param(SEEDS, marks=pytest.mark.wide)], ids=len)
@pytest.mark.slow
def test_runs_at_once_each_in_its_own_1_GiB_cgroup_equal_each_run_alone(tmp_path, seeds):
    assert MemoryCgroup.available(), "this test runs zinfjax train in cgroup v1 memory groups: run it as root"
    alone = {s: _together(tmp_path / "alone", [s])[s] for s in seeds}  # one at a time
    together = _together(tmp_path / "together", seeds)
    print(json.dumps({k: {s: {f: v for f, v in r.items() if f != "stderr"} for s, r in runs.items()}
                      for k, runs in (("alone", alone), ("together", together))}))
    for run in [*alone.values(), *together.values()]:
        _assert_ran(run)
    assert max(r["started"] for r in together.values()) < min(r["ended"] for r in together.values())  # overlapped
    for s in seeds:
        assert _losses(tmp_path / "together", s) == _losses(tmp_path / "alone", s), s
        assert len(_losses(tmp_path / "alone", s)) == STEPS
        _assert_same(_params(tmp_path / "together", s), _params(tmp_path / "alone", s))
    assert len({tuple(_losses(tmp_path / "alone", s)) for s in seeds}) == len(seeds)  # distinct runs
