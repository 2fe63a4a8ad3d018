"""The disk's floor under each step: the NVMe bytes it moved at the disk's probed rates, and the step over it.

A run whose state uses the nvme tier probes the disk once, before its first step (`probe_disk`: 256 MiB
written then read with O_DIRECT under its ``nvme_path``, then half of it read back while the other half is
written), and every step's log entry gains:

- ``io_floor_s``: ``max(read_bytes_nvme / disk_read, write_bytes_nvme / disk_write, (read_bytes_nvme +
  write_bytes_nvme) / disk_mixed)``: the least time the disk needs for the step's NVMe bytes, its reads and
  writes overlapping at best (the engine reads ahead while it writes behind), at the rate the disk moves both
  at once (`zinfjax.planning.probes.disk_seconds`; a disk that shares its bandwidth between them, as this
  project's virtio disk does, takes about their sum), as `zinfjax.planning.cost.predict`'s floor on the CPU
  backend;
- ``floor_ratio``: ``step_s / max(compute alone, io_floor_s)``: 1.0 is the step at its floor, where compute
  alone is known: the plan's calibrated compute (a timed step with every tier on device, scaled to the model)
  when ``tiers=auto`` probed;
- ``io_ratio``: ``step_s / io_floor_s`` where it is not. It bounds the floor ratio from above (the floor is at
  least the disk's part). The step's own ``compute_s`` (``step_s - stall_s``) is no stand-in for compute
  alone: it holds the I/O path's CPU work and the wait for the last writes too, so a ratio over it would read
  about 1.0 whatever the step did.

Example (``Floor.for_run(nvme_path, plan)`` probes the disk under the run's ``nvme_path``; here a disk of 1 GB/s
each way, and compute alone unknown):
    >>> floor = Floor({"read_GBps": 1.0, "write_GBps": 1.0})
    >>> floor.fields({"step_s": 2.0, "compute_s": 1.2, "read_bytes_nvme": 10**9, "write_bytes_nvme": 10**9})
    {'io_floor_s': 1.0, 'io_ratio': 2.0}
    >>> timed = Floor({"read_GBps": 1.0, "write_GBps": 1.0}, compute_alone_s=1.6)      # compute alone known
    >>> timed.fields({"step_s": 2.0, "read_bytes_nvme": 10**9})
    {'io_floor_s': 1.0, 'floor_ratio': 1.25}
"""

from __future__ import annotations

import time

from zinfjax.planning.probes import PROBE_BYTES, disk_seconds, probe_disk


def probe(nvme_path: str, nbytes: int = PROBE_BYTES) -> dict:
    """The disk's O_DIRECT rates under ``nvme_path`` as the log records them (``disk_probe``), or a ``note``
    saying why there are none: ``{"read_GBps", "write_GBps", "bytes", "seconds"}``."""
    t0 = time.perf_counter()
    try:
        rates = probe_disk(nvme_path, nbytes)
    except OSError as e:
        return {"note": f"no O_DIRECT probe under {nvme_path} ({e.strerror or e}): io_floor_s is not logged"}
    if "disk_note" in rates:
        return {"note": rates["disk_note"].replace("nominal disk figures", "io_floor_s is not logged")}
    return {"read_GBps": rates["disk_read_GBps"], "write_GBps": rates["disk_write_GBps"],
            "mixed_GBps": rates.get("disk_mixed_GBps"), "bytes": nbytes, "seconds": time.perf_counter() - t0}


def plan_compute(plan: dict | None) -> float | None:
    """The plan's calibrated compute for the placement it chose, when it timed one (``tiers=auto`` with probes): the
    step's compute alone, without the forward a lean budget recomputes in the backward (the in-memory step's)."""
    if not plan or not plan.get("probed") or "calibration_layers" not in plan.get("rates", {}):
        return None  # nominal figures (no probes, or timing runs that did not fit the budget): not a measurement
    chosen = plan["recommended"]["tiers"]
    row = next((row for row in plan["placements"] if row["tiers"] == chosen), None)
    return None if row is None else row.get("compute_alone_s", row["compute_s"])


class Floor:
    """A run's disk rates and compute basis, and each step's ``io_floor_s`` and ``floor_ratio`` from them."""

    def __init__(self, disk: dict, compute_alone_s: float | None = None):
        self.disk = disk  # `probe`'s answer
        self.compute_alone_s = compute_alone_s  # None: unknown (io_ratio, not floor_ratio)

    @classmethod
    def for_run(cls, nvme_path: str, plan: dict | None = None) -> Floor:
        """Probes the disk under ``nvme_path``; takes compute alone from ``plan`` where it timed it."""
        return cls(probe(nvme_path), plan_compute(plan))

    @property
    def ok(self) -> bool:
        return "read_GBps" in self.disk

    def log_facts(self) -> dict:
        """What the log records at its top level: ``disk_probe`` and ``floor_compute`` (where compute alone
        comes from)."""
        if self.compute_alone_s is None:
            compute = {"source": None, "note": "compute alone is timed by tiers=auto's plan only: each step logs "
                                               "io_ratio (step_s / io_floor_s), an upper bound of floor_ratio"}
        else:
            compute = {"source": "plan", "compute_alone_s": self.compute_alone_s}
        return {"disk_probe": self.disk, "floor_compute": compute}

    def fields(self, record: dict) -> dict:
        """``io_floor_s`` and ``floor_ratio`` of a step's metrics; nothing without disk rates."""
        if not self.ok:
            return {}
        rates = {"disk_read_GBps": self.disk["read_GBps"], "disk_write_GBps": self.disk["write_GBps"],
                 "disk_mixed_GBps": self.disk.get("mixed_GBps")}
        io_floor = disk_seconds(record.get("read_bytes_nvme", 0), record.get("write_bytes_nvme", 0), rates)
        out = {"io_floor_s": io_floor}
        if self.compute_alone_s is not None:
            out["floor_ratio"] = record["step_s"] / max(self.compute_alone_s, io_floor)
        elif io_floor > 0:
            out["io_ratio"] = record["step_s"] / io_floor
        return out
