"""zinfjax's worker threads by name, and the CPU time each kind of thread spends.

Python names its threads for itself only; the kernel, ``top -H`` and ``/proc`` see every thread
under the process's name. `executor` makes pools whose threads carry their Python name into the
kernel (the first 15 bytes: ``zinf-read-param``, ``zinf-chunk-io_3``), so `cpu_seconds` can split
the process's CPU time by role: the main thread (which dispatches the engine), XLA's compute
threads, the NVMe tier's readers, writers and chunk I/O, checkpoint saves, and the other threads
(the runtime's unnamed ones and any Python thread of the program's own).

Example:
    >>> pool = executor(2, "zinf-demo")
    >>> pool.submit(lambda: None).result()
    >>> sorted(cpu_seconds())[:3]
    ['checkpoint', 'chunk_io', 'main']
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

PR_SET_NAME = 15  # prctl(2)
ROLES = (  # (OS thread name prefix, role); the first match wins
    ("zinf-read", "read"),
    ("zinf-write", "write"),
    ("zinf-chunk", "chunk_io"),
    ("zinf-ckpt", "checkpoint"),
    ("tf_", "xla"),
    ("XLA", "xla"),
    ("llvm", "xla"),
)
ALL_ROLES = sorted({"main", "other", *(role for _, role in ROLES)})
IO_ROLES = ("read", "write", "chunk_io")  # the NVMe tier's I/O path: staging copies, checksums, system calls
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def name_in_kernel() -> None:
    """Gives the calling thread its Python name in the kernel too (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def executor(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A thread pool whose threads are named ``prefix_N`` in Python and in the kernel."""
    return ThreadPoolExecutor(workers, thread_name_prefix=prefix, initializer=name_in_kernel)


def role(name: str, main: bool = False) -> str:
    """The role of a thread by its kernel name (``main``: it is the process's main thread).

    Example:
        >>> role("zinf-read-param"), role("tf_XLAEigen"), role("zinfjax"), role("zinfjax", main=True)
        ('read', 'xla', 'other', 'main')
    """
    if main:
        return "main"
    return next((r for prefix, r in ROLES if name.startswith(prefix)), "other")


def io_cpu_seconds(metrics: dict) -> float:
    """The CPU seconds of the NVMe tier's I/O path in a step's metrics (their ``cpu_s_<role>`` of `IO_ROLES`).

    Example:
        >>> io_cpu_seconds({"cpu_s_read": 0.5, "cpu_s_write": 0.25, "cpu_s_xla": 9.0})
        0.75
    """
    return sum(metrics.get(f"cpu_s_{role}", 0.0) for role in IO_ROLES)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) this process's live threads have used, summed by `role`.

    Threads that have exited are not counted: take differences over a span in which the pools live.
    """
    out = dict.fromkeys(ALL_ROLES, 0.0)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread exited meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[role(name, main=int(tid) == os.getpid())] += (int(fields[11]) + int(fields[12])) / _TICK
    return out
