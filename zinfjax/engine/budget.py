"""The host memory budget: from one number, the engine's buffers, read-ahead and writes in flight.

``memory_limit`` (default: the smaller of this process's memory cgroup limit and the memory the
machine has available, less a margin) is what the whole process may hold. The engine measures
what it holds already when it starts (the JAX runtime, the traced program), reserves room for
XLA's compiler, and splits the rest:

- ``host_buffer_bytes``: staging for writes (and, off the CPU backend, reads) to NVMe: room for
  two slices' writes in flight, and at least one;
- writes in flight: slices handed to a tier and not yet staged, which the engine still holds: two
  slices' worth;
- ``prefetch_depth``: how many operations' reads run ahead of compute (1 to 4), and as many
  computations may be queued behind it: what the rest of the budget holds, at three times the size
  of the largest operation's reads (its reads ahead, and a queued operation's inputs and outputs).

A key set explicitly is kept. A budget too small for even one slice in flight is refused before
anything is written, naming the smallest budget that would work (docs/engine.md, "Memory").

Example:
    >>> plan = plan_budget(config, read_bytes=90 << 20, write_bytes=85 << 20)
    >>> plan.prefetch_depth, plan.host_buffer_bytes
    (2, 178257920)
"""

from __future__ import annotations

import dataclasses
import os

from zinfjax import rss
from zinfjax.errors import UserError
from zinfjax.units import format_bytes

UNLIMITED = 1 << 60
# What XLA's compiler and a step's temporaries take above the steady state, measured on the CPU
# backend (docs/BENCHMARKS.md, "Memory"): the first step compiles every stage function.
COMPILE_RESERVE = 192 << 20
# Between the process's RSS and what its cgroup charges (page tables, kernel buffers, the pages of
# files it reads through tensorstore's metadata), measured under `bench memory`.
MARGIN_FRACTION = 0.08
MARGIN_MIN = 64 << 20
MAX_DEPTH = 4
# What one step of read-ahead costs: an operation's reads ahead of compute, and, as many computations
# are let run ahead of the loop, one more operation's inputs and outputs (engine.py, `_run`).
LIVE_PER_DEPTH = 3
MIN_BUFFERS = 1 << 20


class MemoryBudgetError(UserError):
    """The memory budget cannot hold what one step needs."""


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What the engine holds under a budget, and where the budget came from."""

    limit: int
    source: str
    baseline: int
    prefetch_depth: int
    host_buffer_bytes: int
    write_bytes_in_flight: int  # slices handed to a tier and not yet written, which the engine still holds

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


def plan_budget(config, read_bytes: int, write_bytes: int, resident: int = 0,
                baseline: int | None = None) -> BudgetPlan:
    """The buffers and read-ahead ``config`` gets, for operations of ``read_bytes`` and slices of ``write_bytes``.

    ``resident`` is the state the process holds whole (stores on the host tier, and on the device
    tier where device memory is host memory).

    Raises:
        MemoryBudgetError: the budget cannot hold one operation's reads, one slice staged and the
            compiler's reserve; the message names the smallest budget that would.
    """
    if config.memory_limit:
        limit, source = int(config.memory_limit), "memory_limit"
    else:
        limit, source = default_limit()
    baseline = rss.current_bytes() if baseline is None else baseline
    least = baseline + resident + COMPILE_RESERVE + write_bytes + LIVE_PER_DEPTH * read_bytes
    if limit < least:
        held = f", {format_bytes(resident)} of state held in memory" if resident else ""
        raise MemoryBudgetError(
            f"a memory budget of {format_bytes(limit)} ({source}) cannot train this model: the process holds "
            f"{format_bytes(baseline)} already{held}, and one step needs "
            f"{format_bytes(LIVE_PER_DEPTH * read_bytes)} for a layer read ahead and one computing, and "
            f"{format_bytes(write_bytes)} for a staged write, besides the compiler's {format_bytes(COMPILE_RESERVE)}; "
            f"the smallest budget that would work is {format_bytes(least)} (set memory_limit, move state to nvme, or "
            "give the process more memory)")
    spare = limit - baseline - resident - COMPILE_RESERVE
    buffers = config.host_buffer_bytes or max(write_bytes, min(2 * write_bytes, spare // 4), MIN_BUFFERS)
    in_flight = 2 * max(write_bytes, read_bytes // 2, MIN_BUFFERS)
    depth = config.prefetch_depth
    if depth is None:
        room = (spare - buffers - in_flight) // max(LIVE_PER_DEPTH * read_bytes, 1)
        depth = int(max(1, min(MAX_DEPTH, room)))
    return BudgetPlan(limit, source, baseline, depth, int(buffers), int(in_flight))


def with_defaults(config, prefetch_depth: int = 2, host_buffer_bytes: int = 256 << 20):
    """``config`` with fixed defaults for the keys a budget would set (inference, which holds no state to plan)."""
    return config.replace(prefetch_depth=prefetch_depth if config.prefetch_depth is None else config.prefetch_depth,
                          host_buffer_bytes=config.host_buffer_bytes or host_buffer_bytes)
