"""How busy the machine is: CPU seconds every core spent busy, and this process's own, so that what other
processes took while something was timed can be told apart (a shared machine skews every timing).

Example:
    >>> with OtherLoad() as load:
    ...     time.sleep(0.05)                    # what is timed
    >>> load.cores >= 0.0                       # the cores other processes kept busy meanwhile, on average
    True
"""

from __future__ import annotations

import os
import resource
import time


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


class OtherLoad:
    """A context that measures the cores other processes kept busy on average while it was open (``cores``)."""

    cores = 0.0

    def __enter__(self) -> OtherLoad:
        self._busy, self._own, self._start = machine_busy_s(), own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.perf_counter() - self._start, 1e-9)
        other = (machine_busy_s() - self._busy) - (own_cpu_s() - self._own)
        self.cores = max(0.0, other / wall)
