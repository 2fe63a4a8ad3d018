"""glibc malloc settings for streaming layers through one process.

The engine allocates and frees layer-sized buffers all the time, from the JAX runtime and from
its I/O threads. glibc's defaults serve that badly in two ways:

- every thread gets its own malloc arena, so a buffer freed by an I/O thread is not reused by
  the thread that allocates the next one, and the peak RSS grows with fragmentation;
- above its mmap threshold every allocation is a fresh ``mmap``: page faults and zeroing on
  first touch, ``munmap`` on free. At a low threshold this costs more CPU than the copies of
  the I/O path (on a 2-core machine, a quarter of the NVMe step).

A third cost is page faults themselves: XLA's CPU runtime allocates each step's large buffers afresh
(the vocabulary's parameters, gradients and Adam state, the in-memory step's whole scratch), and
glibc maps them anew, 4 KiB pages faulted in one by one: 1.3 GB a step for GPT-2 small in memory,
a fifth of its step. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` glibc asks for transparent huge
pages (`madvise`), so the same memory faults 512 times less often. glibc reads its tunables only
when a process starts, so ``zinfjax train``, ``plan`` and ``generate`` start themselves again with it
(`huge_pages_env`, `restart_with_huge_pages`); ``ZINFJAX_HUGE_PAGES=0`` turns that off. A program of
your own sets it in its environment.

`tune_allocator` sets one arena and a fixed mmap threshold above the layer buffers, so freed
buffers are reused at once and the peak RSS stays what the engine holds, and lets the heap keep
`KEEP_FREE` of free memory at its top, so the buffers of the next layer (and the next step) reuse
pages already faulted in. It suits a process
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
import os
import platform
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
DEFAULT_MMAP_THRESHOLD = 32 << 20  # the largest glibc allows on 64-bit is 32 MiB
# The free memory at the heap's top that glibc keeps for the next buffers instead of returning it. Fixing
# the mmap threshold leaves glibc's own trim threshold at 128 KiB, so every layer freed at the top went
# back to the system and the next was faulted in afresh (huge pages zeroed: 15% of the CPU time of
# gpt2-small's NVMe step). Keeping 256 MiB made that step 6-10% faster for 0.03-0.06 GB more peak
# (docs/BENCHMARKS.md, "Fewer reads, and the heap keeps its pages between layers").
KEEP_FREE = 256 << 20
GLIBC_TRIM_THRESHOLD = 128 << 10  # glibc's default: what a capped run (zinfjax.engine.budget) goes back to


def tune_allocator(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, arenas: int = 1,
                   trim_threshold: int = KEEP_FREE, late: bool = False) -> bool:
    """Sets glibc's arena count, a fixed mmap threshold and the free memory the heap keeps (``trim_threshold``);
    returns whether glibc took them. ``late``: called once threads have allocated (the engine lowering the threshold
    for a capped run), which does not count as the heap tuned first (`tuned`).

    Example:
        >>> tune_allocator(mmap_threshold=1 << 20)   # every block over 1 MiB from its own mmap
        True
    """
    global _tuned
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    took = (bool(mallopt(M_ARENA_MAX, arenas)) and bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold))
            and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold)))
    _tuned = _tuned or (took and not late)
    return took


_tuned = False


def tuned() -> bool:
    """Whether `tune_allocator` has run in this process. A heap tuned only after threads had allocated has an arena
    per thread, each keeping its own freed pages: a capped engine keeps none then (`zinfjax.engine.budget.heap_room`;
    gpt2-large at 5 GiB was killed by its cgroup so)."""
    return _tuned


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


def describe(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, arenas: int = 1, trim_threshold: int = KEEP_FREE) -> str:
    """The settings as the benchmarks report them."""
    return (f"glibc malloc: {arenas} arena(s), M_MMAP_THRESHOLD fixed at {mmap_threshold >> 20} MiB, "
            f"M_TRIM_THRESHOLD {trim_threshold >> 20} MiB")


HUGE_PAGES = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: madvise(MADV_HUGEPAGE) on the memory malloc maps
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages() -> bool:
    """Whether this process's malloc was started with transparent huge pages (`HUGE_PAGES` in GLIBC_TUNABLES)."""
    return HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "").split(":")


def thp_mode(path: str = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``); None where there is none.

    Example:
        >>> thp_mode("/nonexistent")  # not Linux, or a kernel without THP
    """
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def huge_pages_env(environ: dict[str, str], libc: str, mode: str | None) -> dict[str, str] | None:
    """``environ`` with `HUGE_PAGES` added to GLIBC_TUNABLES, or None when there is nothing to add: it is
    there already, ``ZINFJAX_HUGE_PAGES=0``, the C library is not glibc, or the kernel has no THP.

    Example:
        >>> huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "glibc", "madvise")["GLIBC_TUNABLES"]
        'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1'
        >>> huge_pages_env({"ZINFJAX_HUGE_PAGES": "0"}, "glibc", "madvise") is None
        True
    """
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    if (HUGE_PAGES in tunables or environ.get("ZINFJAX_HUGE_PAGES") == "0" or libc != "glibc"
            or mode in (None, "never")):
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join([*tunables, HUGE_PAGES])}


def with_huge_pages(environ: dict[str, str]) -> dict[str, str] | None:
    """`huge_pages_env` for this machine's C library and kernel."""
    return huge_pages_env(environ, platform.libc_ver()[0], thp_mode())


def restart_with_huge_pages() -> None:
    """Starts this process again, the same command line (``sys.orig_argv``), with `with_huge_pages`; returns
    only when there is nothing to add. Call it first thing, before any thread or output.
    """
    env = with_huge_pages(dict(os.environ))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
