"""Short probes of this machine: the disk's direct-I/O rates under ``nvme_path`` and the host copy rate."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import jax
import numpy as np

MiB = 1 << 20


PROBE_BYTES = 256 * MiB  # the disk probe: 64 MiB swung 2x from run to run on the benchmark machine


def probe_disk(nvme_path: str, nbytes: int = PROBE_BYTES) -> dict:
    """Sequential O_DIRECT write and read bandwidth under ``nvme_path`` (`raw_direct_io`), and both at once
    (`mixed_direct_io`), in GB/s."""
    from zinfjax.store.probe import mixed_direct_io, raw_direct_io

    os.makedirs(nvme_path, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".zinfjax-plan-", dir=nvme_path)
    os.close(fd)
    try:
        out = raw_direct_io(path, nbytes)
        mixed = mixed_direct_io(path, nbytes)
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs): the figures stay nominal
        if os.path.exists(path):
            os.remove(path)
        return {"disk_note": f"no O_DIRECT probe ({e.strerror or e}); nominal disk figures"}
    return {"disk_read_GBps": out["raw_read_GBps"], "disk_write_GBps": out["raw_write_GBps"],
            "disk_mixed_GBps": mixed}


def disk_seconds(read_bytes: float, write_bytes: float, rates: dict) -> float:
    """The least time the disk needs for a step's NVMe bytes, its reads and writes overlapping at best: each at its
    own rate, and both together at the rate the disk moves them at once where that was probed (``disk_mixed_GBps``:
    a disk that shares its bandwidth between reading and writing takes about their sum).

    Example:
        >>> disk_seconds(2e9, 2e9, {"disk_read_GBps": 2.0, "disk_write_GBps": 2.0})
        1.0
        >>> disk_seconds(2e9, 2e9, {"disk_read_GBps": 2.0, "disk_write_GBps": 2.0, "disk_mixed_GBps": 2.0})
        2.0
    """
    alone = max(read_bytes / (rates["disk_read_GBps"] * 1e9), write_bytes / (rates["disk_write_GBps"] * 1e9))
    mixed = rates.get("disk_mixed_GBps")
    return max(alone, (read_bytes + write_bytes) / (mixed * 1e9)) if mixed else alone


def probe_host_copy(nbytes: int = 8 * MiB, repeats: int = 5) -> float:
    """GB/s of ``device_put`` between device memory and ``pinned_host`` and back, as the host tier copies.

    ``nbytes`` is one copy: the size of one layer's largest leaf, as the tier copies leaf by leaf (the
    rate falls by 2-3x from 8 to 64 MiB on the CPU backend, where a large copy faults in fresh pages).
    """
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    on_device = SingleDeviceSharding(dev, memory_kind="device")
    on_host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    x = jax.device_put(np.ones(nbytes // 4, np.float32), on_device).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = jax.device_put(jax.device_put(x, on_host).block_until_ready(), on_device).block_until_ready()
        times.append(time.perf_counter() - t0)
        del y
    return 2 * nbytes / statistics.median(times) / 1e9
