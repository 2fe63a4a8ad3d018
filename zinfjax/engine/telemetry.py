"""What a step reports: loss, bytes moved per tier, time stalled on I/O, compute time, overlap.

The metrics of one step (all times in seconds, wall clock of the host thread driving the step):

- ``loss``: the step's mean loss over its micro-batches.
- ``read_bytes_<tier>`` / ``write_bytes_<tier>``: bytes the step's stores read from and wrote
  to each tier (``device``, ``host``, ``nvme``), from the stores' own counters.
- ``read_bytes_<tier>_per_device`` / ``write_bytes_<tier>_per_device``: bytes that the busiest
  device moved from or to each tier: for every read, the device's own shard of each leaf;
  for every write, the shards whose first local copy it holds. A replicated leaf costs each
  device all of it; a leaf split over N devices costs each 1/N: the aggregate bandwidth of
  ZeRO-Infinity's bandwidth-centric partitioning.
- ``host_link_bytes``: bytes that crossed between host memory and the compute devices, both
  directions summed (every shard of each leaf, counted when the copy is issued). With the update
  on the device: every read from and write to the ``host`` and ``nvme`` tiers (NVMe data is
  staged in host memory). With the update on the host (``update_on``): the optimizer state and
  master stay in host memory, and the link carries the gradients down and the new compute copy up
  (and the compute copy when it is the master, in fp32). On the CPU backend host and device are
  one memory, so this is what the same run would move over PCIe on an accelerator.
- ``cpu_s_<role>``: CPU seconds (user + system) the process's threads of each role used during the
  step (`zinfjax.store.threads`): ``main`` (the thread that dispatches the engine), ``xla`` (compute),
  ``read`` / ``write`` / ``chunk_io`` (the NVMe tier's I/O path: staging copies, checksums, system
  calls), ``checkpoint``, ``other`` (the runtime's unnamed threads). With 2 cores, ``sum / step_s``
  near 2 means the step is CPU-bound.
- ``step_s``: the whole step, until its last write has landed.
- ``stall_s``: time the step waited for a read it needed next (``future.result()`` in the
  read-ahead). Reads issued ahead that complete before they are needed cost no stall.
- ``compute_s``: ``step_s - stall_s``: the time the step was not waiting for reads
  (dispatching and running compute, issuing writes, waiting for the last writes).
- ``read_s``: the wall time during which at least one read was in flight (the union of
  every read's issue-to-completion interval).
- ``overlap``: the fraction of that read time hidden behind compute,
  ``1 - stall_s / read_s`` (1.0 when the step never waited for a read, 0.0 when it waited
  for every read from start to end; 1.0 when nothing was read).

``zinfjax train`` adds, for a run with state on the nvme tier, ``io_floor_s`` and ``floor_ratio``: the step's
NVMe bytes at the disk's probed rates, and the step over its floor (`zinfjax.training.floor`, docs/engine.md).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from zinfjax.engine.readahead import ReadAhead, ReadEvent
from zinfjax.store.threads import cpu_seconds


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def device_read_bytes(store, keys=None) -> int:
    """Bytes one read of a layer (or of its leaves ``keys``) brings to the busiest device: its own shard of each leaf.

    Example (8 devices; on a CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> from zinfjax.sharding import make_mesh
        >>> from zinfjax.store import open_store
        >>> split = NamedSharding(make_mesh({"data": 8}), P(None, "data"))    # each layer's rows over 8 devices
        >>> store = open_store("host", {"w": jax.ShapeDtypeStruct((4, 2048, 1024), jnp.float32, sharding=split)})
        >>> device_read_bytes(store)   # a layer of 8 MiB split over 8 devices: 1 MiB
        1048576
        >>> store.close()
    """
    per_device: Counter = Counter()
    for lay in _layouts(store, keys):
        for shard in lay.shards:
            for d in shard.devices:
                per_device[d] += lay.shard_nbytes
    return max(per_device.values(), default=0)


def device_write_bytes(store, keys=None) -> int:
    """Bytes one write of a layer (or of its leaves ``keys``) costs the busiest device: the shards whose first
    replica it holds."""
    per_device: Counter = Counter()
    for lay in _layouts(store, keys):
        for shard in lay.shards:
            if shard.writer and shard.devices:
                per_device[shard.devices[0]] += lay.shard_nbytes
    return max(per_device.values(), default=0)


def _layouts(store, keys) -> list:
    return store.layouts if keys is None else [store.layouts[k] for k in store.leaf_indices(keys)]


class StepTelemetry:
    """Collects one step's figures from the stores' counters and the read schedules.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from zinfjax.store import open_store
        >>> store = open_store("host", {"w": jax.ShapeDtypeStruct((4, 256), jnp.float32)})   # layers of 1 KiB
        >>> t = StepTelemetry([store])
        >>> store.write(0, {"w": jnp.ones(256)}).result(); t.add_write(store, 0)   # what the step does
        >>> metrics = t.finish(loss=2.3)
        >>> metrics["loss"], metrics["write_bytes_host"], metrics["write_bytes_host_per_device"]
        (2.3, 1024, 1024)
        >>> store.close()
    """

    def __init__(self, stores: list, tracer=None):
        self.start = time.perf_counter()
        self.stores = stores
        self.tracer = tracer  # a zinfjax.engine.trace.Tracer, or None
        if tracer is not None:
            tracer.step_begin()
        self.before = [(s.stats.bytes_read, s.stats.bytes_written) for s in stores]
        self.cpu_before = cpu_seconds()
        self.stall_s = 0.0
        self.events: list[ReadEvent] = []
        self.per_device: dict[str, int] = defaultdict(int)
        self._layer_bytes: dict[tuple, int] = {}
        self.link_bytes = 0

    def add_reads(self, reads: ReadAhead) -> None:
        self.stall_s += reads.stall_s
        self.events += reads.events
        for group in reads.groups:
            for r in group:
                if r.store.tier is None:  # parameters the forward kept (engine/reuse.py): nothing read
                    continue
                tier = r.store.tier_at(r.layer)
                self.per_device[f"read_bytes_{tier}_per_device"] += self._bytes(r.store, "read", r.keys)
                if r.store.memory_kind_at(r.layer) != "device" and r.memory_kind == "device":
                    self.link_bytes += r.store.part_nbytes(r.keys)
        if self.tracer is not None:
            self.tracer.reads(reads.events)

    def add_write(self, store, i: int, keys=None, from_host: bool = False) -> None:
        """Counts layer ``i`` (or its leaves ``keys``) written to ``store`` by the step (``from_host``: arrays
        already in host memory, which do not cross the host link to reach the host or NVMe tier)."""
        self.per_device[f"write_bytes_{store.tier_at(i)}_per_device"] += self._bytes(store, "write", keys)
        if store.memory_kind_at(i) != "device" and not from_host:
            self.link_bytes += store.part_nbytes(keys)

    def add_link(self, nbytes: int) -> None:
        """Counts bytes a computation moved between device and host memory (the update on the host's
        gradients going down and compute copy coming up)."""
        self.link_bytes += nbytes

    def _bytes(self, store, op: str, keys=None) -> int:
        key = (id(store), op, keys)
        if key not in self._layer_bytes:
            self._layer_bytes[key] = (device_read_bytes if op == "read" else device_write_bytes)(store, keys)
        return self._layer_bytes[key]

    def bytes_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for store, (r0, w0) in zip(self.stores, self.before, strict=True):
            out[f"read_bytes_{store.tier}"] += store.stats.bytes_read - r0
            out[f"write_bytes_{store.tier}"] += store.stats.bytes_written - w0
        return dict(out)

    def finish(self, **extra) -> dict:
        """The step's metrics; call after the step's last write has landed."""
        end = time.perf_counter()
        step_s = end - self.start
        if self.tracer is not None:
            self.tracer.step_end(self.start, end)
        io = [(e.issue_t, e.complete_t) for e in self.events if e.complete_t is not None]
        io_s = union_seconds(io)
        overlap = 1.0 - min(self.stall_s / io_s, 1.0) if io_s > 0 else 1.0
        return {
            **extra,
            "step_s": step_s,
            "stall_s": self.stall_s,
            "compute_s": step_s - self.stall_s,
            "read_s": io_s,
            "overlap": overlap,
            **self.bytes_by_tier(),
            "host_link_bytes": self.link_bytes,
            **{f"cpu_s_{k}": max(0.0, v - self.cpu_before.get(k, 0.0)) for k, v in cpu_seconds().items()},
            **self.per_device,
        }

