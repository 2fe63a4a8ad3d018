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
    """Sequential O_DIRECT write and read bandwidth under ``nvme_path`` (`raw_direct_io`), in GB/s."""
    from zinfjax.store.probe import raw_direct_io

    os.makedirs(nvme_path, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".zinfjax-plan-", dir=nvme_path)
    os.close(fd)
    try:
        out = raw_direct_io(path, nbytes)
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs): the figures stay nominal
        if os.path.exists(path):
            os.remove(path)
        return {"disk_note": f"no O_DIRECT probe ({e.strerror or e}); nominal disk figures"}
    return {"disk_read_GBps": out["raw_read_GBps"], "disk_write_GBps": out["raw_write_GBps"]}


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
