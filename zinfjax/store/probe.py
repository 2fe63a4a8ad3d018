"""How fast the disk under a directory is: sequential O_DIRECT writes and reads, as fio measures them.

The I/O floor of the benchmarks and the disk rates of `zinfjax plan` both come from here.

Example (8 MiB here; the plan probes 256 MiB):
    >>> import tempfile
    >>> rates = raw_direct_io(f"{tempfile.mkdtemp()}/probe.bin", 8 << 20)
    >>> sorted(rates), all(rate > 0 for rate in rates.values())
    (['raw_read_GBps', 'raw_write_GBps'], True)
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time

import numpy as np

MiB = 1 << 20


def raw_direct_io(path: str, nbytes: int, block: int = MiB, depth: int = 16) -> dict[str, float]:
    """Sequential O_DIRECT write (then fsync) and read of `nbytes` with `depth` blocks in flight.

    Each of `depth` threads takes the next block offset in turn, so `depth` consecutive blocks
    are in flight, as fio's iodepth keeps them.
    """
    nblocks = nbytes // block
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        _run_threads(depth, lambda buf, off: os.pwrite(fd, buf, off), nblocks, block, fill=True)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _run_threads(depth, lambda buf, off: os.preadv(fd, [buf], off), nblocks, block, fill=False)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(path)
    moved = nblocks * block
    return {"raw_write_GBps": moved / write_s / 1e9, "raw_read_GBps": moved / read_s / 1e9}


def mixed_direct_io(path: str, nbytes: int, block: int = MiB, depth: int = 16) -> float:
    """GB/s the disk moves reading and writing at once: the first half of `nbytes` written to ``path``, then read
    back with `depth` / 2 blocks in flight while as many write its second half; both halves over the wall time. It
    takes no more space than `raw_direct_io`.

    A disk that reads and writes at full speed together moves about the sum of its two rates here; one that shares
    its bandwidth between them (this project's virtio disk: 1.6-1.9 GB/s together against 1.8-2.0 read and
    2.2-2.5 write alone) about one rate.
    """
    half = max(nbytes // block // 2, 1)
    start = half * block
    lanes = max(depth // 2, 1)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_TRUNC, 0o644)
    failed: list[BaseException] = []

    def write_second_half():
        try:
            _run_threads(lanes, lambda buf, off: os.pwrite(fd, buf, start + off), half, block, fill=True)
        except BaseException as e:  # noqa: BLE001 - raised in the caller after the join
            failed.append(e)

    try:
        _run_threads(depth, lambda buf, off: os.pwrite(fd, buf, off), half, block, fill=True)
        os.fsync(fd)
        writer = threading.Thread(target=write_second_half)
        t0 = time.perf_counter()
        writer.start()
        _run_threads(lanes, lambda buf, off: os.preadv(fd, [buf], off), half, block, fill=False)
        writer.join()
        if failed:
            raise failed[0]
        os.fsync(fd)
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.remove(path)
    return 2 * half * block / wall / 1e9


def _run_threads(depth: int, op, nblocks: int, block: int, fill: bool) -> None:
    counter = itertools.count()
    errors: list[BaseException] = []

    def worker():
        buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
        if fill:
            buf.write(np.random.default_rng().integers(0, 256, block, dtype=np.uint8).tobytes())
        try:
            while (k := next(counter)) < nblocks:
                if op(buf, k * block) != block:
                    raise OSError(f"short transfer at block {k}")
        except BaseException as e:  # noqa: BLE001 - reported after join
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
