"""I/O benchmark: the nvme tier against raw direct I/O on the same filesystem.

It writes and then reads N bytes of layer chunks through the store, and in the same run measures
what the filesystem itself gives to sequential O_DIRECT I/O with 1 MiB blocks and 16 requests in
flight (what `fio --direct=1 --bs=1M --iodepth=16` measures). Store writes are timed until they
are durable; store reads are timed cold, after dropping the page cache.

Example:
    $ python bench/io.py --dir /mnt/nvme/bench --bytes 2GiB
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import re
import shutil
import threading
import time

import jax
import numpy as np

from zinfjax.store import BufferPool, Prefetcher, open_store

MiB = 1 << 20
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": MiB,
    "mb": 10**6,
    "mib": MiB,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """Bytes in a size such as "2GiB", "512MiB", "1e9" or "4096".

    Example:
        >>> parse_size("2GiB")
        2147483648
    """
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r}; write e.g. 2GiB, 512MiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def drop_page_cache() -> bool:
    """Writes back and drops the page cache (needs root); returns whether it could."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def syncfs(path: str) -> None:
    """Flushes every dirty page of the filesystem holding `path`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        ctypes.CDLL(None, use_errno=True).syncfs(fd)
    finally:
        os.close(fd)


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


def store_io(
    directory: str, nbytes: int, chunk_bytes: int, depth: int, cold: bool = True, **options
) -> dict[str, float]:
    """Writes then cold-reads `nbytes` of layer chunks through the nvme tier."""
    rows = chunk_bytes // 4096
    layers = max(1, nbytes // (rows * 4096))
    like = {"w": jax.ShapeDtypeStruct((layers, rows, 4096), np.uint8)}
    layer = {"w": np.random.default_rng(0).integers(0, 256, (rows, 4096), dtype=np.uint8)}
    pool = BufferPool((depth + 1) * rows * 4096)
    shutil.rmtree(os.path.join(directory, "bench"), ignore_errors=True)
    store = open_store("nvme", like, path=directory, name="bench", pool=pool, **options)
    try:
        t0 = time.perf_counter()
        for i in range(layers):
            store.write(i, layer)
        store.flush()
        syncfs(store.directory)
        write_s = time.perf_counter() - t0
        cold = cold and drop_page_cache()
        t0 = time.perf_counter()
        for _, tree in Prefetcher(store, range(layers), depth):
            tree["w"].block_until_ready()
        read_s = time.perf_counter() - t0
    finally:
        store.close()
        shutil.rmtree(store.directory, ignore_errors=True)
    moved = layers * rows * 4096
    return {
        "store_write_GBps": moved / write_s / 1e9,
        "store_read_GBps": moved / read_s / 1e9,
        "store_bytes": moved,
        "layers": layers,
        "cache_policy": "page cache dropped before store reads (raw reads use O_DIRECT)"
        if cold
        else "page cache NOT dropped: store reads may be warm",
        "pool_peak_bytes": pool.peak_bytes,
        "pool_capacity_bytes": pool.capacity_bytes,
    }


def run_io_bench(
    directory: str,
    nbytes: int,
    *,
    chunk_bytes: int = 64 * MiB,
    depth: int = 8,
    raw_depth: int = 16,
    cold: bool = True,
    **options,
) -> dict:
    """Runs the store and the raw-disk measurements on one filesystem and returns their ratio.

    Args:
        directory: a directory on the filesystem under test.
        nbytes: bytes to write and read in each measurement.
        chunk_bytes: bytes per layer chunk.
        depth: reads kept in flight by the prefetcher, and writes the buffer pool admits.
        raw_depth: requests in flight for the raw O_DIRECT baseline.
        cold: drop the page cache before the store reads (needs root).
        **options: nvme tier options (file_io_concurrency, file_io_sync, read_threads, ...).

    Example:
        >>> run_io_bench("/mnt/nvme/bench", 2 << 30)["read_ratio"]  # doctest: +SKIP
        0.93
    """
    os.makedirs(directory, exist_ok=True)
    raw = raw_direct_io(os.path.join(directory, "raw.bin"), nbytes, depth=raw_depth)
    store = store_io(directory, nbytes, chunk_bytes, depth, cold, **options)
    return {
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in {**store, **raw}.items()},
        "read_ratio": round(store["store_read_GBps"] / raw["raw_read_GBps"], 4),
        "write_ratio": round(store["store_write_GBps"] / raw["raw_write_GBps"], 4),
        "bytes": nbytes,
        "chunk_bytes": chunk_bytes,
        "prefetch_depth": depth,
        "raw": f"O_DIRECT, 1 MiB blocks, {raw_depth} in flight, fsync at end",
        "store_durability": "file_io_sync (fsync per chunk) + syncfs before the clock stops",
        "options": options,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: `zinfjax bench io --dir PATH --bytes N`; prints one JSON object."""
    parser = argparse.ArgumentParser(prog="zinfjax bench io", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="a directory on the filesystem to measure")
    parser.add_argument("--bytes", default="2GiB", type=parse_size, help="bytes to move, e.g. 2GiB")
    parser.add_argument("--chunk-bytes", default="64MiB", type=parse_size, help="bytes per layer chunk")
    parser.add_argument("--depth", default=8, type=int, help="prefetch depth / writes in flight")
    parser.add_argument("--file-io-concurrency", default=32, type=int)
    parser.add_argument("--read-threads", default=8, type=int)
    parser.add_argument("--write-threads", default=8, type=int)
    args = parser.parse_args(argv)
    result = run_io_bench(
        args.dir,
        args.bytes,
        chunk_bytes=args.chunk_bytes,
        depth=args.depth,
        file_io_concurrency=args.file_io_concurrency,
        read_threads=args.read_threads,
        write_threads=args.write_threads,
    )
    print(json.dumps(result))
    return 0
