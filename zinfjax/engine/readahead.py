"""Reads that run ahead of compute: a schedule of read groups, ``depth`` groups in flight.

zinfjax's one read-ahead mechanism: the engine's steps, generation, evaluation and the store
benchmark all read through it.

The order of every read in a step is known before the step starts. A group holds the
reads one operation's compute needs (a layer's parameters and activation checkpoint, its
optimizer state or a part of it). `ReadAhead` keeps the next ``depth`` groups in flight while
the consumer works on the current one, and more while the groups ahead hold no more bytes than
``depth`` of the schedule's largest group: the bound on memory is that of ``depth`` groups, and
small groups (the 29 vocabulary chunks of gpt2-small's embedding, each a few milliseconds of
compute behind its optimizer state's read) are read far enough ahead that the disk keeps pace.
A read may carry a readiness test (an activation checkpoint must be written before it is read
back, a layer the forward keeps for its backward must have been computed): a group not ready is
passed over and issued once it is, at the latest when its turn comes, so that the groups behind it
are read meanwhile (gpt2-small's backward read its first blocks' optimizer state only after the
forward of every vocabulary chunk, whose backward takes what that forward kept: 0.27 s of a 2.7 s
step with the disk idle).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

from zinfjax.errors import UserError


class ReadAheadError(UserError):
    """A read-ahead depth that is not a count."""


@dataclasses.dataclass(frozen=True)
class Read:
    """One read: ``store.read(layer, keys, memory_kind)`` under a telemetry ``track`` name (``keys``: a part of
    the layer; ``memory_kind``: where the arrays land, device memory unless the update on the host reads them)."""

    track: str
    store: object
    layer: int
    ready: Callable[[], bool] | None = None
    keys: tuple[str, ...] | None = None
    memory_kind: str = "device"


@dataclasses.dataclass
class ReadEvent:
    """Telemetry of one read (``time.perf_counter`` seconds)."""

    track: str
    layer: int
    issue_t: float
    complete_t: float | None = None


class ReadAhead:
    """Yields each group's results (a list, in the group's order), keeping ``depth`` groups ahead.

    ``depth=0`` reads each group on demand. Beyond ``depth`` groups, a group is issued while the groups
    ahead of the one consumed, with it, hold at most ``depth`` times the largest group's bytes
    (``store.part_nbytes``). ``max_ahead`` is the most groups that were in flight beyond the one being
    consumed; ``events`` has one `ReadEvent` per read, in issue order.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from zinfjax.store import open_store
        >>> store = open_store("host", {"w": jax.ShapeDtypeStruct((6, 4, 4), jnp.float32)})   # 6 layers
        >>> for i in range(6):
        ...     _ = store.write(i, {"w": jnp.full((4, 4), i / 10)})
        >>> h, ahead = jnp.ones(4), ReadAhead([[Read("params", store, i)] for i in range(6)], depth=2)
        >>> for (layer,) in ahead:                  # layers i+1 and i+2 are read while layer i computes
        ...     h = jnp.tanh(h @ layer["w"])
        >>> ahead.max_ahead, len(ahead.events)
        (2, 6)
        >>> store.close()
    """

    def __init__(self, groups: Sequence[Sequence[Read]], depth: int):
        if depth < 0:
            raise ReadAheadError(f"prefetch depth={depth} must be 0 or more; set prefetch_depth=0 or above")
        self.groups = [list(g) for g in groups]
        self.depth = depth
        sizes = [_bytes_by_kind(g) for g in self.groups]
        kinds = {kind for size in sizes for kind in size}
        # per memory kind, so that neither device nor host memory holds more than `depth` groups' worth
        self._allowance = {kind: depth * max(size.get(kind, 0) for size in sizes) for kind in kinds}
        self._ends = list(itertools.accumulate(sizes, lambda a, b: a + b))  # bytes of groups 0..k, per kind
        self.events: list[ReadEvent] = []
        self.stall_s = 0.0
        self.max_ahead = 0
        self._pending: dict[int, list] = {}  # the issued groups not yet consumed: their futures, by index
        self._waiting: list[int] = []  # groups passed over while not ready, not yet issued
        self._next = 0  # the first group neither issued nor waiting
        self._consumed = 0

    def __iter__(self):
        return self

    def __next__(self) -> list:
        if self._consumed >= len(self.groups):
            raise StopIteration
        current = self._consumed
        self._fill(current, due=current)
        futures = self._pending.pop(current)
        self.max_ahead = max(self.max_ahead, len(self._pending))
        self._consumed += 1
        start = time.perf_counter()
        results = [f.result() for f in futures]
        self.stall_s += time.perf_counter() - start
        self._fill(current, due=-1)  # while group `current` is worked on: the groups after it, when ready
        return results

    def _fill(self, current: int, due: int) -> None:
        """Issues the groups up to ``due`` (ready or not: their turn has come), then up to ``depth`` groups after
        ``current``, and more within the allowance; a group not ready yet is passed over until it is."""
        for k in [k for k in self._waiting if k <= due or _ready(self.groups[k])]:
            self._waiting.remove(k)
            self._issue(k)
        while self._next < len(self.groups):
            k = self._next
            if k > current + self.depth and not self._within_allowance(current, k):
                return
            self._next += 1
            if k > due and not _ready(self.groups[k]):
                self._waiting.append(k)
            else:
                self._issue(k)

    def _within_allowance(self, current: int, k: int) -> bool:
        """Whether groups ``current+1..k`` hold no more of any memory kind than ``depth`` of the largest group."""
        ahead = self._ends[k] - self._ends[current]
        return all(n <= self._allowance[kind] for kind, n in ahead.items())

    def _issue(self, k: int) -> None:
        futures = []
        for r in self.groups[k]:
            event = ReadEvent(r.track, r.layer, time.perf_counter())
            self.events.append(event)
            fut = r.store.read(r.layer, r.keys, r.memory_kind)
            fut.add_done_callback(lambda _, e=event: setattr(e, "complete_t", time.perf_counter()))
            futures.append(fut)
        self._pending[k] = futures


def _ready(group: list[Read]) -> bool:
    return all(r.ready is None or r.ready() for r in group)


def _bytes_by_kind(group: list[Read]) -> collections.Counter:
    """The bytes a group's reads bring into memory, per memory kind."""
    out: collections.Counter = collections.Counter()
    for r in group:
        out[r.memory_kind] += r.store.part_nbytes(r.keys)
    return out
