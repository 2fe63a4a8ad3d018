"""What a step reports: loss, bytes moved per tier, time stalled on I/O, compute time, overlap.

The metrics of one step (all times in seconds, wall clock of the host thread driving the step):

- ``loss``: the step's mean loss over its micro-batches.
- ``read_bytes_<tier>`` / ``write_bytes_<tier>``: bytes the step's stores read from and wrote
  to each tier (``device``, ``host``, ``nvme``), from the stores' own counters.
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
"""

from __future__ import annotations

import time
from collections import defaultdict

from zinfjax.engine.readahead import ReadAhead, ReadEvent


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class StepTelemetry:
    """Collects one step's figures from the stores' counters and the read schedules.

    Example:
        >>> t = StepTelemetry(stores); ...; metrics = t.finish(loss=2.3)
    """

    def __init__(self, stores: list, tracer=None):
        self.start = time.perf_counter()
        self.stores = stores
        self.tracer = tracer  # a zinfjax.engine.trace.Tracer, or None
        if tracer is not None:
            tracer.step_begin()
        self.before = [(s.stats.bytes_read, s.stats.bytes_written) for s in stores]
        self.stall_s = 0.0
        self.events: list[ReadEvent] = []

    def add_reads(self, reads: ReadAhead) -> None:
        self.stall_s += reads.stall_s
        self.events += reads.events
        if self.tracer is not None:
            self.tracer.reads(reads.events)

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
        }
