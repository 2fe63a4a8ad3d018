"""SIGKILL in the middle of a save and of a step; the memory a save takes.

Invariant 4 (docs/design.md): a kill at either point leaves the last complete checkpoint readable, and
training resumed from it gives the losses of a run that was never killed.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tests.checkpoint.test_checkpoint import losses_after, restore
from tests.support.checkpoint_child import NVME
from tests.support.engine_helpers import batches, config, make_engine
from tests.support.mounts import tmpfs
from zinfjax.checkpoint import CheckpointManager, complete_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.support.checkpoint_child", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when_ready(proc: subprocess.Popen, root, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (root / "ready").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the child never reached the point to kill it at"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@functools.cache
def uninterrupted() -> list[float]:
    c = config(nvme_path=tempfile.mkdtemp(prefix="zinfjax-plain-"), **NVME)
    engine, data = make_engine(c), batches(c)
    losses = [engine.train_step(next(data))["loss"] for _ in range(4)]
    engine.close()
    shutil.rmtree(c.nvme_path)
    return losses


def test_sigkill_during_an_async_save_resumes_from_the_last_complete(tmp_path):
    proc = child("kill-in-save", tmp_path)
    kill_when_ready(proc, tmp_path)
    ckpt = tmp_path / "ckpt"
    assert complete_steps(str(ckpt)) == [2]
    assert os.listdir(ckpt / ".tmp-4" / "params")  # the half-written save is there, under no step number
    CheckpointManager(str(ckpt)).close()  # a new run clears it
    assert sorted(os.listdir(ckpt)) == ["2"]
    c = config(nvme_path=str(tmp_path / "nvme"), **NVME)
    engine, source = restore(c, str(ckpt))
    assert source.step == 2
    assert losses_after(engine, c, source.data_position, 2) == uninterrupted()[2:]
    engine.close()


def test_sigkill_mid_step_falls_back_to_the_checkpoint_and_says_so(tmp_path):
    proc = child("kill-in-step", tmp_path)
    kill_when_ready(proc, tmp_path)
    c = config(nvme_path=str(tmp_path / "nvme"), **NVME)
    engine, source = restore(c, str(tmp_path / "ckpt"))  # on the same, half-updated working store
    assert engine.interrupted_step == 4 and source.step == 2
    assert losses_after(engine, c, source.data_position, 2) == uninterrupted()[2:]
    engine.close()


@pytest.mark.parametrize("where", ["same filesystem (hard links)", "another filesystem (kernel copy)"])
def test_saving_from_nvme_stays_within_training_peak_rss(tmp_path, where):
    if where.startswith("same"):
        out = child("rss", tmp_path, tmp_path / "ckpt").communicate()
        figures = json.loads(out[0].strip().splitlines()[-1])
    else:
        with tmpfs(tmp_path / "other", "64m") as other:
            out = child("rss", tmp_path, other / "ckpt").communicate()
            figures = json.loads(out[0].strip().splitlines()[-1])
    print(where, figures)
    assert figures["save_peak_rss"] <= 1.1 * figures["train_peak_rss"]
    assert np.isfinite(figures["save_peak_rss"])
