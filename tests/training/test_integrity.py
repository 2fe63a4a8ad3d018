"""A bit that flips in the live state on NVMe, between the write of a chunk and its next read.

A ``zinfjax train`` run keeps every part on NVMe and saves every 2 steps. Once a save is committed, the run is
stopped (SIGSTOP) at a moment when no save is under way and some chunks on NVMe were written after it: state no
checkpoint holds (one link: `chunkfile.write_chunks` replaces a linked chunk, never overwrites it), which the
run reads again in its next step. One bit of each such chunk is flipped on the disk, and the run continues
(SIGCONT). It must stop in one line naming a flipped chunk and the newest checkpoint that verifies (a chunk
flipped just before a save linked it is in that checkpoint too: the line says it skips it), and ``resume=true``
ends bit-identical to a run never interrupted.

With ``verify_chunks=false`` the same flip goes unseen: the store returns the flipped bytes (what the switch
gives up, docs/store.md "Integrity").
"""

from __future__ import annotations

import mmap
import os
import re
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import train_runs
from tests.support.train_runs import chunk_files, finish, losses, the_error
from zinfjax.checkpoint import complete_steps
from zinfjax.checkpoint.verify import verify_checkpoint
from zinfjax.store import StoreCorruptionError
from zinfjax.store.chunkfile import BLOCK
from zinfjax.store.layout import leaf_layout
from zinfjax.store.nvme import NvmeStore

STEPS, LATEST = 10, 6  # the flip lands after a save of step 2, 4 or 6, so the run reads the flipped chunks again
SETTINGS = ["model=gpt2-tiny", "batch_size=2", "seq_len=16", "mesh=data:1", "save_every=2", "keep_checkpoints=3",
            "params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme", f"steps={STEPS}"]


def start(cache, save_dir, nvme_path, log, *settings) -> subprocess.Popen:
    return train_runs.start(SETTINGS, cache, save_dir, nvme_path, log, *settings)


def live_chunks(nvme_path) -> list[str]:
    """The chunk files under ``nvme_path`` that no checkpoint links: written since the last save."""
    out = []
    for root, _, names in os.walk(nvme_path):
        if "c" in os.path.relpath(root, nvme_path).split(os.sep):
            out += [os.path.join(root, n) for n in names
                    if n.isdigit() and os.stat(os.path.join(root, n)).st_nlink == 1
                    and os.path.getsize(os.path.join(root, n)) > BLOCK + 4]
    return out


def flip_a_bit(path: str, seed: int) -> None:
    """Flips one bit of the chunk's data (not its trailing checksum) on the disk, under the page cache: a block
    read and written back with O_DIRECT, as the disk itself would change it (a buffered write would leave
    the page cache and the engine's O_DIRECT reads seeing different bytes)."""
    size = os.path.getsize(path)
    body = (size - 4) // BLOCK * BLOCK
    assert body, f"{path} has no whole block to flip"
    at = int(np.random.default_rng(seed).integers(0, body))
    block = mmap.mmap(-1, BLOCK)  # page aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        start = at // BLOCK * BLOCK
        assert os.preadv(fd, [block], start) == BLOCK
        block[at - start] ^= 0x10
        assert os.pwritev(fd, [block], start) == BLOCK
        os.fsync(fd)
    finally:
        os.close(fd)
        block.close()


def stop_with_live_chunks(proc: subprocess.Popen, save_dir, nvme_path, files: list[str]) -> tuple[int, list[str]]:
    """Stops ``proc`` once a save is committed, at a moment when live chunks exist and every save under way has
    linked all its ``files`` (a snapshot links its chunks between two steps, so none of the live ones will be a
    checkpoint's), early enough that the run reads them again; returns the last complete step and the chunks."""
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGSTOP)
        saved = complete_steps(save_dir)
        assert not saved or saved[-1] <= LATEST, f"no moment to flip a bit was found before step {LATEST}"
        under_way = [os.path.join(save_dir, n) for n in os.listdir(save_dir) if n.startswith(".tmp-")] if saved else []
        linked = all(os.path.exists(os.path.join(d, f)) for d in under_way for f in files)
        live = live_chunks(nvme_path) if saved and linked else []
        if live:
            return saved[-1], live
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.005)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    finish(start(root.parent / "jax-cache", root / "ckpt", root / "nvme", root / "log.json"))
    return losses(root / "log.json"), chunk_files(root / "ckpt" / str(STEPS)), root.parent / "jax-cache"


@pytest.mark.slow
def test_a_bit_flipped_in_the_live_state_stops_the_run_naming_the_chunk_and_resume_ends_bit_identical(
        tmp_path, reference):
    want_losses, want_files, cache = reference
    save_dir, nvme_path = tmp_path / "ckpt", tmp_path / "nvme"
    proc = start(cache, save_dir, nvme_path, tmp_path / "log.json")
    saved, flipped = stop_with_live_chunks(proc, save_dir, nvme_path, list(want_files))
    for k, path in enumerate(flipped):
        flip_a_bit(path, k)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)

    line = the_error(proc.returncode, err)
    assert line.startswith("the run's state on NVMe is damaged: corrupt chunk in leaf '"), line
    assert "crc32c mismatch in chunk file " in line, line
    named = line.split("crc32c mismatch in chunk file ")[1].split(":")[0]
    assert named in flipped, (named, flipped[:5])
    # A chunk flipped before the next save linked it is in that checkpoint too: the line names the newest that
    # verifies, and says which it skipped.
    last = int(re.search(rf"the last complete checkpoint is step (\d+) in {re.escape(str(save_dir))}", line)[1])
    skipped = [s for s in complete_steps(save_dir) if s > last]
    assert last >= saved and line.endswith(
        (f" (step {', '.join(map(str, skipped))} fails its checksums; resume skips it)" if skipped else "")
        + " (resume=true)"), line
    assert verify_checkpoint(str(save_dir / str(last))).complete
    assert all(not verify_checkpoint(str(save_dir / str(s))).complete for s in skipped)

    resumed = tmp_path / "resumed.json"
    finish(start(cache, save_dir, nvme_path, resumed, "resume=true"))
    got = losses(resumed)
    assert min(got) == last + 1 and max(got) == STEPS, got
    assert got == {s: want_losses[s] for s in got}  # bit-identical: exact floats
    files = chunk_files(save_dir / str(STEPS))
    assert files.keys() == want_files.keys() and [k for k in files if files[k] != want_files[k]] == []


@pytest.mark.parametrize("verify", [True, False])
def test_verify_chunks_false_reads_a_flipped_chunk_unchecked(tmp_path, verify):
    like = {"w": jax.ShapeDtypeStruct((2, 64, 64), jnp.float32)}
    store = NvmeStore(like, [leaf_layout("w", like["w"], None)], str(tmp_path / "w"), verify=verify)
    try:
        store.write(1, {"w": jnp.full((64, 64), 3.0)}).result()
        (chunk,) = live_chunks(tmp_path / "w")
        flip_a_bit(chunk, 0)
        if verify:
            with pytest.raises(StoreCorruptionError, match=f"layer 1 of store .*crc32c mismatch in chunk file {chunk}"):
                store.read(1).result()
        else:
            got = np.asarray(store.read(1).result()["w"])
            assert (got != 3.0).sum() == 1  # the flipped value, returned as it is
    finally:
        store.close()
