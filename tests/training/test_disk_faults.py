"""A disk that fails under a ``zinfjax train`` run, with EIO from the kernel.

``nvme_path`` (every tier on NVMe) or ``save_dir`` lives on ext4 over a loop device that fails on command
(`tests.support.faulty_disk`: this kernel has no device-mapper, so the fault comes from the loop device's
backing store, through FUSE). A fault lands mid-step, on NVMe reads or writes, or mid-save. Each time:

- the run exits within 60 s of the fault, with status 2 and one error line, no traceback, naming the file
  (and for the NVMe tier the layer and the leaf) and the last complete checkpoint;
- no committed checkpoint is lost: every step the save_dir lists verifies;
- once the fault is lifted (fsck, mount again), ``resume=true`` ends bit-identical to a run never
  interrupted: the same losses, and the final checkpoint's chunk files byte for byte.

A write fault can surface as a failed read: the kernel reports the failed writeback of a chunk's page
cache to the next O_DIRECT read of that file, and after ext4 aborts its journal every write is EROFS.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.support import train_runs
from tests.support.faulty_disk import FaultyDisk, unavailable
from tests.support.train_runs import chunk_files, finish, losses, the_error, verify_cli
from zinfjax.checkpoint import complete_steps
from zinfjax.checkpoint.verify import verify_save_dir

STEPS, FAULT_AFTER = 6, 3  # the fault lands once the save of step 3 began: in step 4, or in that save
SETTINGS = ["model=gpt2-tiny", "batch_size=2", "seq_len=16", "mesh=data:1", "save_every=1", "keep_checkpoints=2",
            "params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme", "grad_clip=1.0", f"steps={STEPS}"]

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no faulty disk here: {unavailable()}")


def start(cache, save_dir, nvme_path, log, *settings) -> subprocess.Popen:
    return train_runs.start(SETTINGS, cache, save_dir, nvme_path, log, *settings)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run, never interrupted, on a healthy disk: its losses, its final checkpoint's files, and the JAX
    compilation cache every run shares (it spares them most of their start-up)."""
    root = tmp_path_factory.mktemp("reference")
    finish(start(root.parent / "jax-cache", root / "ckpt", root / "nvme", root / "log.json"))
    return losses(root / "log.json"), chunk_files(root / "ckpt" / str(STEPS)), root.parent / "jax-cache"


@pytest.fixture
def disk(tmp_path):
    with FaultyDisk(tmp_path / "disk") as d:
        yield d


CASES = {  # case: (what the faulty disk holds, which I/O fails, the error's first words)
    "nvme-read": ("nvme", "reads", ("NVMe read failed: [Errno 5] Input/output error: ",)),
    "nvme-write": ("nvme", "writes", ("NVMe write failed: [Errno ", "NVMe read failed: [Errno 5] ")),
    "mid-save": ("save", "writes", ("the final checkpoint (step 6) was not saved: ",)),
}


# make test runs the NVMe read fault (about 50 s with the reference run); make test-all adds the other two.
@pytest.mark.parametrize("case", ["nvme-read", pytest.param("nvme-write", marks=pytest.mark.wide),
                                  pytest.param("mid-save", marks=pytest.mark.wide)])
@pytest.mark.slow
def test_a_disk_fault_stops_the_run_in_one_line_and_resume_ends_bit_identical(tmp_path, disk, reference, case):
    held, mode, openings = CASES[case]
    healthy = tmp_path / "healthy"
    save_dir = disk.mount + "/ckpt" if held == "save" else str(healthy / "ckpt")
    nvme_path = disk.mount + "/nvme" if held == "nvme" else str(healthy / "nvme")
    want_losses, want_files, cache = reference

    proc = start(cache, save_dir, nvme_path, tmp_path / "log.json")
    began = [os.path.join(save_dir, f".tmp-{FAULT_AFTER}"), os.path.join(save_dir, str(FAULT_AFTER))]
    deadline = time.monotonic() + 300
    while not any(os.path.exists(p) for p in began):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"the save of step {FAULT_AFTER} never began"
        time.sleep(0.002)
    disk.fail(mode)
    faulted = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{case}: the run still ran 60 s after the fault: {proc.communicate()[1][-3000:]}")
    seconds = time.monotonic() - faulted
    print(f"{case}: exit {proc.returncode} {seconds:.1f} s after the fault; stderr:\n{err}")

    line = the_error(proc.returncode, err)
    assert line.startswith(openings), line
    if held == "nvme":
        assert f"{disk.mount}/nvme/" in line and "(layer " in line and " of leaf '" in line, line
        assert f"the last complete checkpoint is step {max(complete_steps(save_dir))} in {save_dir}" in line, line
    else:
        assert f"({disk.mount}/ckpt" in line and "the newest checkpoint is step" in line, line
    assert seconds < 60

    disk.repair()  # the fault lifted: unmount, e2fsck, mount
    committed = complete_steps(save_dir)
    assert committed and max(committed) >= FAULT_AFTER - 1, committed  # what was committed before the fault
    assert all(c.complete for c in verify_save_dir(save_dir) if c.step in committed)
    if held == "nvme":
        checked = verify_cli(save_dir)
        assert checked.returncode == 0, checked.stdout + checked.stderr

    resumed_log = tmp_path / "resumed.json"
    finish(start(cache, save_dir, nvme_path, resumed_log, "resume=true"))
    got = losses(resumed_log)
    assert min(got) == max(committed) + 1 and max(got) == STEPS, got
    assert got == {s: want_losses[s] for s in got}  # bit-identical: exact floats
    files = chunk_files(os.path.join(save_dir, str(STEPS)))
    assert files.keys() == want_files.keys() and len(files) > 50
    assert [k for k in files if files[k] != want_files[k]] == []
    checked = verify_cli(save_dir)
    assert checked.returncode == 0, checked.stdout + checked.stderr
