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
import json
import os
import shutil
import time

import jax
import numpy as np

from zinfjax._util.byte_sizes import parse_bytes
from zinfjax.engine.readahead import Read, ReadAhead
from zinfjax.errors import ConfigError
from zinfjax.runtime.cpu_load import own_cpu_s
from zinfjax.store import BufferPool, open_store, staging_bytes
from zinfjax.store.probe import raw_direct_io  # noqa: F401 - the benchmarks' name for it

MiB = 1 << 20


def parse_size(text: str) -> int:
    """`parse_bytes` for argparse: "2GiB", "512MiB", "1e9" or "4096" in bytes.

    Example:
        >>> parse_size("2GiB")
        2147483648
    """
    try:
        return parse_bytes(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


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


def store_io(
    directory: str, nbytes: int, chunk_bytes: int, depth: int, cold: bool = True, **options
) -> dict[str, float]:
    """Writes then cold-reads `nbytes` of layer chunks through the nvme tier; the process's CPU seconds (user +
    system, every thread) per GB of each."""
    rows = chunk_bytes // 4096
    layers = max(1, nbytes // (rows * 4096))
    like = {"w": jax.ShapeDtypeStruct((layers, rows, 4096), np.uint8)}
    layer = {"w": np.random.default_rng(0).integers(0, 256, (rows, 4096), dtype=np.uint8)}
    pool = BufferPool((depth + 1) * staging_bytes(like))
    shutil.rmtree(os.path.join(directory, "bench"), ignore_errors=True)
    store = open_store("nvme", like, path=directory, name="bench", pool=pool, **options)
    try:
        t0, c0 = time.perf_counter(), own_cpu_s()
        for i in range(layers):
            store.write(i, layer)
        store.flush()
        syncfs(store.directory)
        write_s, write_cpu = time.perf_counter() - t0, own_cpu_s() - c0
        cold = cold and drop_page_cache()
        t0, c0 = time.perf_counter(), own_cpu_s()
        for (tree,) in ReadAhead([[Read("w", store, i)] for i in range(layers)], depth):
            tree["w"].block_until_ready()
        read_s, read_cpu = time.perf_counter() - t0, own_cpu_s() - c0
    finally:
        store.close()
        shutil.rmtree(store.directory, ignore_errors=True)
    moved = layers * rows * 4096
    return {
        "store_write_GBps": moved / write_s / 1e9,
        "store_read_GBps": moved / read_s / 1e9,
        "store_write_cpu_s_per_GB": write_cpu / moved * 1e9,
        "store_read_cpu_s_per_GB": read_cpu / moved * 1e9,
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
    rounds: int = 1,
    **options,
) -> dict:
    """Runs the store and the raw-disk measurements on one filesystem and returns their ratio.

    With several `rounds`, each round measures raw then store, the ratios are taken within each
    round (the disk's speed drifts between rounds), and the reported figures are the medians.

    Args:
        directory: a directory on the filesystem under test.
        nbytes: bytes to write and read in each measurement.
        chunk_bytes: bytes per layer chunk.
        depth: reads kept in flight by the prefetcher, and writes the buffer pool admits.
        raw_depth: requests in flight for the raw O_DIRECT baseline.
        cold: drop the page cache before the store reads (needs root).
        rounds: how many (raw, store) pairs to measure.
        **options: nvme tier options (chunk_io, file_io_sync, read_threads, ...).

    Example (8 MiB with the page cache kept; ``zinfjax bench io`` moves GBs from a cold cache, its ratio about 0.93):
        >>> import tempfile
        >>> result = run_io_bench(tempfile.mkdtemp(), 8 << 20, chunk_bytes=1 << 20, cold=False)
        >>> result["read_ratio"] > 0, result["bytes"], result["statistic"]
        (True, 8388608, 'one round')
    """
    os.makedirs(directory, exist_ok=True)
    per_round = [_one_round(directory, nbytes, chunk_bytes, depth, raw_depth, cold, options) for _ in range(rounds)]
    summary = {key: round(float(np.median([r[key] for r in per_round])), 4) for key in _FIGURES}
    return {
        **summary,
        **{k: v for k, v in per_round[-1].items() if k not in _FIGURES},
        "rounds": per_round if rounds > 1 else None,
        "statistic": f"median of {rounds} rounds (ratios within each round)" if rounds > 1 else "one round",
        "bytes": nbytes,
        "chunk_bytes": chunk_bytes,
        "prefetch_depth": depth,
        "raw": f"O_DIRECT, 1 MiB blocks, {raw_depth} in flight, fsync at end",
        "store_durability": "fsync per chunk (file_io_sync) + syncfs before the clock stops",
        "options": options,
    }


_FIGURES = ("store_write_GBps", "store_read_GBps", "store_write_cpu_s_per_GB", "store_read_cpu_s_per_GB",
            "raw_write_GBps", "raw_read_GBps", "read_ratio", "write_ratio")


def _one_round(directory, nbytes, chunk_bytes, depth, raw_depth, cold, options) -> dict:
    raw = raw_direct_io(os.path.join(directory, "raw.bin"), nbytes, depth=raw_depth)
    store = store_io(directory, nbytes, chunk_bytes, depth, cold, **options)
    return {
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in {**store, **raw}.items()},
        "read_ratio": round(store["store_read_GBps"] / raw["raw_read_GBps"], 4),
        "write_ratio": round(store["store_write_GBps"] / raw["raw_write_GBps"], 4),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: `zinfjax bench io --dir PATH --bytes N`; prints one JSON object."""
    parser = argparse.ArgumentParser(prog="zinfjax bench io", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="a directory on the filesystem to measure")
    parser.add_argument("--bytes", default="2GiB", type=parse_size, help="bytes to move, e.g. 2GiB")
    parser.add_argument("--chunk-bytes", default="64MiB", type=parse_size, help="bytes per layer chunk")
    parser.add_argument("--depth", default=8, type=int, help="prefetch depth / writes in flight")
    parser.add_argument("--rounds", default=3, type=int, help="(raw, store) pairs measured; figures are medians")
    parser.add_argument("--file-io-concurrency", default=32, type=int)
    parser.add_argument("--read-threads", default=8, type=int)
    parser.add_argument("--write-threads", default=8, type=int)
    parser.add_argument(
        "--chunk-io",
        default="direct",
        choices=["direct", "tensorstore"],
        help="direct: the tier's own O_DIRECT chunk I/O (default); tensorstore: tensorstore's read/write path",
    )
    parser.add_argument("--fresh-reads", action="store_true",
                        help="read every chunk into a fresh array, not one an earlier read let go of (the CPU "
                             "backend's reuse_reads=False): what the reuse saves")
    args = parser.parse_args(argv)
    result = run_io_bench(
        args.dir,
        args.bytes,
        chunk_bytes=args.chunk_bytes,
        depth=args.depth,
        rounds=args.rounds,
        file_io_concurrency=args.file_io_concurrency,
        read_threads=args.read_threads,
        write_threads=args.write_threads,
        chunk_io=args.chunk_io,
        reuse_reads=not args.fresh_reads,
    )
    print(json.dumps(result))
    return 0
