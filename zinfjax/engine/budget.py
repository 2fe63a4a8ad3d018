"""The host memory budget: from one number, the engine's buffers, read-ahead and writes in flight.

``memory_limit`` (default: the smaller of this process's memory cgroup limit and the memory the
machine has available, less a margin) is what the whole process may hold. The engine measures
what it holds already when it starts (the JAX runtime, the traced program), reserves room for
XLA's compiler, and splits the rest:

- the minimum (`minimum_bytes`): the operation computing and one read ahead (4 times an
  operation's reads: the reads, the outputs, the gradient, the next reads and the heap's
  fragments), one slice staged and one slice in flight;
- when the budget holds a second slice staged and in flight and one operation read ahead beyond
  that, ``host_buffer_bytes`` and the writes in flight are two slices, ``prefetch_depth`` is 2, and
  what the rest holds goes first to the heap's room (`heap_room`), then to read-ahead depth 3 at twice
  the largest operation's reads;
- otherwise the budget is *lean*: one slice each, one operation read ahead.

With state on NVMe and memory capped (`memory_capped`: ``memory_limit`` or ``host_buffer_bytes`` set,
or a memory cgroup below what is available) and no room for the heap (``keeps_heap`` false), the engine
also lowers glibc's mmap threshold (`NVME_MMAP_THRESHOLD`), so freed layer buffers leave the heap at once,
and trims the heap at each step's start. Otherwise it keeps 32 MiB and lets the heap keep 256 MiB of freed pages
(`zinfjax.runtime.allocator.KEEP_FREE`): every large buffer mapped or faulted afresh costs CPU (gpt2-small on
NVMe: 5.3-5.6 s steps at 4 MiB, 4.5-4.9 s at 32 MiB, peak 1.43 against 1.57 GB; docs/BENCHMARKS.md,
"Profile"; and 6-10% of the step from keeping the pages, "Fewer reads, and the heap keeps its pages
between layers").

A key set explicitly is kept. A budget too small for even one slice in flight is refused before
anything is written, naming the smallest budget that would work (docs/engine.md, "Memory").

Example:
    >>> plan = make_budget(Memory(memory_limit=2 << 30), read_bytes=90 << 20, write_bytes=85 << 20, baseline=300 << 20)
    >>> plan.lean, plan.prefetch_depth, plan.host_buffer_bytes >> 20
    (False, 3, 170)
"""

from __future__ import annotations

import dataclasses
import os

from zinfjax._util.byte_sizes import format_bytes
from zinfjax.errors import UserError
from zinfjax.runtime import rss
from zinfjax.runtime.allocator import KEEP_FREE
from zinfjax.sections import Memory

UNLIMITED = 1 << 60
# What XLA's compiler and a step's temporaries take above the steady state, measured on the CPU
# backend (docs/BENCHMARKS.md, "Memory"): the first step compiles every stage function.
COMPILE_RESERVE = 192 << 20
# Between the process's RSS and what its cgroup charges (page tables, kernel buffers, the pages of
# files it reads through tensorstore's metadata), measured under `bench memory`.
MARGIN_FRACTION = 0.08
MARGIN_MIN = 64 << 20
MAX_DEPTH = 3  # deeper read-ahead bought no step time on 2 cores (docs/BENCHMARKS.md, "Memory"), at 2 reads a step
# What the operation computing and one read ahead of it hold, in units of an operation's reads: the
# reads, the outputs (an update's new params and optimizer state), the gradient, the next reads and
# the heap's fragments; measured with gpt2-small on NVMe (docs/engine.md, "Memory"): 310 MiB at 84 MiB.
LIVE_BASE = 4
# What each further operation of read-ahead adds: its reads, and the inputs and outputs of one more
# computation queued behind the loop (engine.py, `_run`); measured as above, 2.1x its reads.
LIVE_PER_DEPTH = 2
MIN_BUFFERS = 1 << 20
# The glibc mmap threshold with state on NVMe: layer-sized buffers come from their own mappings and
# go back to the system when freed, instead of fragmenting the heap (100-300 MiB less at the peak of
# gpt2-small and llama-1b, at no measurable cost in step time; zinfjax.runtime.allocator).
NVME_MMAP_THRESHOLD = 4 << 20
# The holes a heap that keeps its pages leaves among the state held whole in memory, as a fraction of that state:
# llama-1b bf16 at 16 GiB with 14.7 GB of it in memory peaked at 17.07, 17.34 and 17.74 GB in its first 3 steps
# against 17.18 GB, kept pages and no room for them (docs/engine.md, "Memory"); gpt2-large at 5-11 GiB stayed flat.
HEAP_RESIDENT_FRACTION = 0.10


class MemoryBudgetError(UserError):
    """The memory budget cannot hold what one step needs; ``short``: by how many bytes (0 where not known)."""

    short = 0

    @classmethod
    def short_by(cls, short: int, message: str) -> MemoryBudgetError:
        error = cls(message)
        error.short = short
        return error


@dataclasses.dataclass(frozen=True)
class Budget:
    """What the engine holds under a budget, and where the budget came from: the read-ahead and buffers it derives
    from the ``memory`` settings (`make_budget`), which keep what the user gave."""

    limit: int
    source: str
    baseline: int
    prefetch_depth: int
    host_buffer_bytes: int
    write_bytes_in_flight: int  # slices handed to a tier and not yet written, which the engine still holds
    lean: bool = False  # the budget allows only the minimum: one slice staged, one in flight, no read-ahead
    keeps_heap: bool = True  # room for the freed pages the heap keeps (`heap_room`); else a capped run returns them

    def describe(self) -> str:
        return (f"memory budget {format_bytes(self.limit)} ({self.source}): {format_bytes(self.baseline)} at start, "
                f"prefetch_depth {self.prefetch_depth}, host_buffer_bytes {format_bytes(self.host_buffer_bytes)}")


def cgroup_limit() -> int:
    """This process's memory cgroup limit (v1 or v2), or `UNLIMITED`."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return UNLIMITED
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _read_limit(os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.limit_in_bytes"))
        if controllers == "":
            limit = _read_limit(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.max"))
            if limit < UNLIMITED:
                return limit
    return UNLIMITED


def _read_limit(path: str) -> int:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return UNLIMITED
    return UNLIMITED if text == "max" or int(text) >= UNLIMITED else int(text)


def available_bytes() -> int:
    """Memory the machine can give this process: MemAvailable, plus what the process holds already."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 + rss.current_bytes()


def default_limit() -> tuple[int, str]:
    """The budget when ``memory_limit`` is not set: the smaller of the cgroup's and what is available, less a margin."""
    cgroup, available = cgroup_limit(), available_bytes()
    limit, source = (cgroup, "the memory cgroup's limit") if cgroup < available else (available, "available memory")
    margin = max(MARGIN_MIN, int(MARGIN_FRACTION * limit))
    return limit - margin, f"{source} less a {format_bytes(margin)} margin"


def memory_capped(memory: Memory, budget: Budget) -> bool:
    """Whether the run's memory is capped: ``memory_limit`` or ``host_buffer_bytes`` set, or the budget is a
    memory cgroup's limit. Then the engine trades some step time for a lower peak (module docstring).

    Example:
        >>> plan = Budget(1 << 30, "available memory less a 1.8 GiB margin", 0, 2, 1 << 26, 1 << 26)
        >>> memory_capped(Memory(), plan), memory_capped(Memory(memory_limit=2 << 30), plan)
        (False, True)
    """
    explicit = memory.memory_limit is not None or memory.host_buffer_bytes is not None
    return explicit or budget.source.startswith("the memory cgroup")


def fits_device(nbytes: int, device=None) -> bool:
    """Whether ``nbytes`` fit in half the free memory of ``device`` (default: the first local one), by its
    allocator's statistics; False where it reports none.

    Example:
        >>> fits_device(1 << 20)   # the CPU backend reports no device memory
        False
    """
    import jax

    stats = (device or jax.local_devices()[0]).memory_stats() or {}
    if "bytes_limit" not in stats:
        return False
    return nbytes <= (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) // 2


def make_budget(memory: Memory, read_bytes: int, write_bytes: int, resident: int = 0,
                baseline: int | None = None) -> Budget:
    """The buffers and read-ahead ``memory`` gets, for operations of ``read_bytes`` and slices of ``write_bytes``.

    ``resident`` is the state the process holds whole (stores on the host tier, and on the device
    tier where device memory is host memory).

    Raises:
        MemoryBudgetError: the budget cannot hold one operation's reads, one slice staged and the
            compiler's reserve; the message names the smallest budget that would.
    """
    if memory.memory_limit:
        limit, source = int(memory.memory_limit), "memory_limit"
    else:
        limit, source = default_limit()
    baseline = rss.current_bytes() if baseline is None else baseline
    least = minimum_bytes(baseline, resident, read_bytes, write_bytes)
    if limit < least:
        held = f", {format_bytes(resident)} of state held in memory" if resident else ""
        raise MemoryBudgetError.short_by(least - limit,
            f"a memory budget of {format_bytes(limit)} ({source}) cannot train this model: the process holds "
            f"{format_bytes(baseline)} already{held}, and one step needs "
            f"{format_bytes(LIVE_BASE * read_bytes)} for the layer computing and "
            f"{format_bytes(2 * write_bytes)} for a write staged and one in flight, besides the compiler's "
            f"{format_bytes(COMPILE_RESERVE)}; the smallest budget that would work is {format_bytes(least)} "
            "(set memory_limit, move state to nvme, or give the process more memory)")
    spare = limit - least  # beyond the minimum: a second slice staged and in flight, the heap's room, read-ahead
    ahead = LIVE_PER_DEPTH * max(read_bytes, 1)
    lean = spare < 2 * write_bytes + ahead
    slices = 1 if lean else 2
    buffers = memory.host_buffer_bytes or max(slices * write_bytes, MIN_BUFFERS)
    in_flight = max(slices * write_bytes, MIN_BUFFERS)
    rest = spare - 2 * write_bytes - ahead  # beyond read-ahead depth 2
    room = heap_room(read_bytes, resident)
    keeps_heap = not lean and rest >= room
    depth = memory.prefetch_depth
    if depth is None:  # the minimum holds one operation read ahead (LIVE_BASE was measured so)
        rest -= room if keeps_heap else 0
        depth = 1 if lean else int(min(MAX_DEPTH, 2 + rest // ahead))
    else:
        keeps_heap = keeps_heap and rest - max(depth - 2, 0) * ahead >= room
    return Budget(limit, source, baseline, depth, int(buffers), int(in_flight), lean, keeps_heap)


def heap_room(read_bytes: int, resident: int = 0) -> int:
    """What a capped run needs beyond its read-ahead to let the heap keep its freed pages: the free memory glibc
    keeps at the heap's top (`KEEP_FREE`), one more operation's worth of fragments, and `HEAP_RESIDENT_FRACTION` of
    the state held whole in memory (``resident``), among whose buffers freed ones stay as holes. Without it the
    engine gives freed pages back at once, and faults them in again: a fifth of the CPU time of gpt2-large's step
    at 11 GiB (docs/engine.md, "Memory"). It comes before read-ahead beyond depth 2, which buys less.

    Example:
        >>> heap_room(100 << 20) >> 20, heap_room(100 << 20, resident=10 << 30) >> 20
        (456, 1480)
    """
    return KEEP_FREE + LIVE_PER_DEPTH * max(read_bytes, 1) + int(HEAP_RESIDENT_FRACTION * resident)


def minimum_bytes(baseline: int, resident: int, read_bytes: int, write_bytes: int) -> int:
    """The least a step can be trained in: the process so far, the state held whole, the compiler's
    reserve, one operation computing, one slice staged and one in flight; nothing read ahead.

    Example:
        >>> minimum_bytes(300 << 20, 0, read_bytes=84 << 20, write_bytes=56 << 20) >> 20
        940
    """
    return baseline + resident + COMPILE_RESERVE + LIVE_BASE * read_bytes + 2 * write_bytes


def with_defaults(memory: Memory, prefetch_depth: int = 2, host_buffer_bytes: int = 256 << 20) -> Memory:
    """``memory`` with fixed defaults for the keys a budget would set (inference, which holds no state to plan).

    Example:
        >>> with_defaults(Memory(prefetch_depth=0)).prefetch_depth, with_defaults(Memory()).host_buffer_bytes >> 20
        (0, 256)
    """
    return memory.replace(prefetch_depth=prefetch_depth if memory.prefetch_depth is None else memory.prefetch_depth,
                          host_buffer_bytes=memory.host_buffer_bytes or host_buffer_bytes)
