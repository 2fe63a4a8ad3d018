"""glibc malloc settings for streaming layers through one process.

The engine allocates and frees layer-sized buffers all the time, from the JAX runtime and from
its I/O threads. glibc's defaults serve that badly in two ways:

- every thread gets its own malloc arena, so a buffer freed by an I/O thread is not reused by
  the thread that allocates the next one, and the peak RSS grows with fragmentation;
- above its mmap threshold every allocation is a fresh ``mmap``: page faults and zeroing on
  first touch, ``munmap`` on free. At a low threshold this costs more CPU than the copies of
  the I/O path (on a 2-core machine, a quarter of the NVMe step).

`tune_allocator` sets one arena and a fixed mmap threshold above the layer buffers, so freed
buffers are reused at once and the peak RSS stays what the engine holds. It suits a process
whose state streams from NVMe, where few layers are alive at a time: ``zinfjax train`` calls it
when a tier is ``nvme``, and so does the NVMe run of ``zinfjax bench step``. With the whole state
in memory the single heap fragments instead (peak RSS 1.7x higher in the device run of
``bench step``), so it is not set there. Call it at the start of your own program. Elsewhere
than glibc it does nothing.

Example:
    >>> tune_allocator()
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
M_ARENA_MAX = -8
DEFAULT_MMAP_THRESHOLD = 32 << 20  # the largest glibc allows on 64-bit is 32 MiB


def tune_allocator(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, arenas: int = 1) -> bool:
    """Sets glibc's arena count and a fixed mmap threshold; returns whether glibc took them.

    Example:
        >>> tune_allocator(mmap_threshold=1 << 20)   # every block over 1 MiB from its own mmap
        True
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_ARENA_MAX, arenas)) and bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold))


def trim() -> bool:
    """Returns the heap's free memory to the system (glibc ``malloc_trim``); whether anything was released.

    The engine calls it once the state is written and once its first step has compiled: XLA's
    compiler frees hundreds of MB of scratch memory that glibc would otherwise keep mapped under
    the steps that follow. Elsewhere than glibc it does nothing.

    Example:
        >>> trim()
        True
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def describe(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, arenas: int = 1) -> str:
    """The settings as the benchmarks report them."""
    return f"glibc malloc: {arenas} arena(s), M_MMAP_THRESHOLD fixed at {mmap_threshold >> 20} MiB"
