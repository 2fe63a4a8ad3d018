"""A training process for the checkpoint crash and memory tests, run as ``python -m tests.support.checkpoint_child``.

Modes (argv: MODE ROOT):
- ``kill-in-save``: saves at step 2, then holds the save of step 4 just before its commit;
- ``kill-in-step``: saves at step 2, then holds step 4 half way through its backward pass;
- ``rss SAVE_DIR``: trains 3 steps, then prints the peak RSS of training and of a save to SAVE_DIR.
- ``kill-in-prune SAVE_DIR``: saves step 5 into SAVE_DIR (which holds steps 2 and 4) keeping 2, and
  SIGKILLs itself half way through deleting step 2.
Either hold writes ROOT/ready and sleeps, for the parent to SIGKILL it there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

from tests import conftest  # noqa: F401  (8 simulated devices, as in the tests)
from tests.support.engine_helpers import batches, config, make_engine
from zinfjax.checkpoint import CheckpointManager
from zinfjax.checkpoint import manager as manager_module

RMTREE = shutil.rmtree
NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme", mesh="data:1")


def hold(root: str):
    def wait_here(*args, **kwargs):
        open(os.path.join(root, "ready"), "w").close()
        time.sleep(600)

    return wait_here


def held_at(write, root: str):
    """``write``, which holds at the update of block 1 (the backward pass runs from the last block)."""

    def wrapped(track, store, i, tree, *args, **kwargs):
        if (track, i) == ("params_blocks", 1):
            hold(root)()
        return write(track, store, i, tree, *args, **kwargs)

    return wrapped


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def killed_half_way(path, **kwargs) -> None:
    """``shutil.rmtree`` that, deleting a checkpoint (not a save's temporary directory), deletes half of its
    files (its zinfjax.json sorts last, so it stays), then dies by SIGKILL."""
    if os.path.basename(path).startswith(".tmp-"):
        return RMTREE(path, **kwargs)
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
    for f in files[: len(files) // 2]:
        os.remove(f)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_prune(save_dir: str) -> None:
    engine = make_engine(config(mesh="data:1"))
    manager = CheckpointManager(save_dir, keep=2)
    shutil.rmtree = killed_half_way
    manager.save(engine, step=5)
    manager.wait()


def main(mode: str, root: str, save_dir: str | None = None) -> None:
    if mode == "kill-in-prune":
        return kill_in_prune(root)
    c = config(nvme_path=os.path.join(root, "nvme"), **NVME)
    engine, data = make_engine(c), batches(c)
    manager = CheckpointManager(save_dir or os.path.join(root, "ckpt"))
    if mode == "rss":
        for _ in range(3):
            engine.train_step(next(data))
        train = peak_rss()
        reset_peak_rss()
        manager.save(engine)
        manager.wait()
        print(json.dumps({"train_peak_rss": train, "save_peak_rss": peak_rss()}))
        return
    for step in range(1, 5):
        if step == 4 and mode == "kill-in-step":
            engine._write = held_at(engine._write, root)
        engine.train_step(next(data))
        if step == 2:
            manager.save(engine)
            manager.wait()
    manager_module._commit = hold(root)
    manager.save(engine)
    manager.wait()


if __name__ == "__main__":
    main(*sys.argv[1:])
