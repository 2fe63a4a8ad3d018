"""The prefetcher: reads layers in a known order, a fixed number ahead of the consumer."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator, Sequence

from zinfjax.store.errors import StoreUsageError


@dataclasses.dataclass
class ReadRecord:
    """Telemetry of one prefetched read; times are `time.perf_counter()` seconds.

    Attributes:
        layer: the layer read.
        issue_t: when the read was issued.
        complete_t: when its data was on the device (None until then).
        stall_s: how long the consumer waited for it.
    """

    layer: int
    issue_t: float
    complete_t: float | None = None
    stall_s: float = 0.0


class Prefetcher:
    """Iterates over `(i, layer_tree)` in schedule order, keeping `depth` reads in flight ahead.

    While the consumer works on one layer, the reads of the next `depth` layers of the schedule
    are in flight; `depth=0` reads each layer on demand. Host memory stays bounded by the store's
    buffer pool, whatever the depth.

    Args:
        store: a `LayerStore`.
        schedule: the layer indices in the order they will be needed, e.g. `0..L-1` then `L-1..0`.
        depth: reads kept in flight ahead of the consumer.

    Attributes:
        records: one `ReadRecord` per read, in schedule order.
        max_ahead: the most reads that were in flight ahead of the consumer.

    Example:
        >>> schedule = list(range(L)) + list(reversed(range(L)))   # doctest: +SKIP
        >>> for i, layer in Prefetcher(store, schedule, depth=2):  # doctest: +SKIP
        ...     h = block(layer, h)
    """

    def __init__(self, store, schedule: Sequence[int], depth: int):
        if depth < 0:
            raise StoreUsageError(f"prefetch depth={depth} must be 0 or more; set prefetch_depth=0 or above")
        self.store = store
        self.schedule = [int(i) for i in schedule]
        self.depth = int(depth)
        self.records: list[ReadRecord] = []
        self.max_ahead = 0

    @property
    def stall_s(self) -> float:
        """Total seconds the consumer waited for reads."""
        return sum(r.stall_s for r in self.records)

    def __iter__(self) -> Iterator[tuple[int, object]]:
        inflight: collections.deque = collections.deque()
        issued = 0
        for pos, layer in enumerate(self.schedule):
            while issued < len(self.schedule) and issued <= pos + self.depth:
                inflight.append(self._issue(self.schedule[issued]))
                issued += 1
            self.max_ahead = max(self.max_ahead, len(inflight) - 1)
            fut, record = inflight.popleft()
            start = time.perf_counter()
            tree = fut.result()
            record.stall_s = time.perf_counter() - start
            yield layer, tree

    def _issue(self, layer: int):
        record = ReadRecord(layer, time.perf_counter())
        self.records.append(record)
        fut = self.store.read(layer)
        fut.add_done_callback(lambda _, r=record: setattr(r, "complete_t", time.perf_counter()))
        return fut, record
