"""Read buffers used again once nothing holds them.

On the CPU backend the nvme tier reads each chunk with O_DIRECT into an aligned array that its device
array then adopts without a copy (`zinfjax.store.nvme`). A fresh array per read costs what the copy
saved: the kernel faults in and zeroes every page the disk then overwrites. Measured through the store
with `bench/io.py` (2 GiB in 46 MiB chunks, three
ahead): 0.46 core-seconds per GB read with fresh arrays (``--fresh-reads``), 0.31 with these; 0.26-0.49 and
0.10 when the same store reads a layer of three 46 MiB leaves again and again, as the engine does.

An array is free when only this pool refers to its memory. Every view of it, every device array that
adopted it and every computation that took it over holds a reference to the owner of the memory, so
CPython's reference count of that owner says when the last of them is gone. (JAX lets go of an array
it adopted at its next call, or at a garbage collection, whose callbacks it hooks: where no array is
free, a young-generation collection lets those go first.) A free array goes to the
next read of its size; the pool grows only while every array of that size is in use, and lets go of those
still free once a read has taken what it needs, so it holds what the reads in use hold, and the arrays
freed since the last read.

Example:
    >>> buffers = ReadBuffers()
    >>> [a] = buffers.take([10_000], 4096)
    >>> a.ctypes.data % 4096, a.nbytes
    (0, 10000)
    >>> buffers.take([10_000], 4096)[0].ctypes.data == a.ctypes.data   # `a` is still held: another array
    False
    >>> address = a.ctypes.data; del a
    >>> buffers.take([10_000], 4096)[0].ctypes.data == address          # free again: the same memory
    True
"""

from __future__ import annotations

import gc
import sys
import threading

import numpy as np

MAX_PER_SIZE = 64  # arrays of one size kept at most: beyond, a read takes a fresh one that is not kept
_FREE = 2  # references to an owner that nothing else holds: its one view's ``base``, and getrefcount's argument


class ReadBuffers:
    """Aligned uint8 arrays by size, each handed out again once nothing refers to its memory."""

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse  # False: every array is a fresh one
        self._views: dict[tuple[int, int], list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, sizes: list[int], align: int) -> list[np.ndarray]:
        """Free arrays of these sizes whose data start on an ``align``-byte boundary: ones used before where they are
        free, else new ones (uninitialised). The arrays of those sizes still free after are let go, so the pool
        keeps no more than the reads in use need."""
        if not self.reuse:
            return [aligned_bytes(n, align) for n in sizes]
        with self._lock:
            out = [self._take(n, align) for n in sizes]
            self._drop_free({(n, align) for n in sizes})
            return out

    def drop_free(self) -> None:
        """Lets go of every array nothing uses now."""
        with self._lock:
            self._drop_free(set(self._views))

    def _drop_free(self, keys: set) -> None:
        for key in keys:
            self._views[key] = [v for v in self._views[key] if not _is_free(v)]

    def _take(self, nbytes: int, align: int) -> np.ndarray:
        views = self._views.setdefault((nbytes, align), [])
        free = _first_free(views)
        if free is None and views:
            gc.collect(0)  # runs JAX's callback, which drops the references its freed arrays held
            free = _first_free(views)
        if free is not None:
            return free[:]  # a view of its own, so that a caller's view keeps the owner held
        fresh = aligned_bytes(nbytes, align)
        if len(views) < MAX_PER_SIZE:
            views.append(fresh)
        return fresh[:]

    def held_bytes(self) -> int:
        """The bytes of every array this pool keeps, in use or free."""
        with self._lock:
            return sum(v.nbytes for views in self._views.values() for v in views)

    def clear(self) -> None:
        """Forgets every array: each is freed once its last user lets it go."""
        with self._lock:
            self._views.clear()


def _first_free(views: list[np.ndarray]) -> np.ndarray | None:
    return next((v for v in views if _is_free(v)), None)


def _is_free(view: np.ndarray) -> bool:
    return sys.getrefcount(view.base) <= _FREE


def aligned_bytes(nbytes: int, align: int) -> np.ndarray:
    """``nbytes`` uninitialised bytes starting on an ``align``-byte boundary: a view whose ``base`` owns them.

    Example:
        >>> aligned_bytes(100, 64).ctypes.data % 64
        0
    """
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]
