"""A bounded pool of page-aligned host buffers.

Every host-side byte the nvme tier stages (reads on their way to the device, writes on their
way to disk) lives in a buffer from this pool. The pool never holds more than its capacity,
counting buffers in use and buffers kept for reuse, so host memory is set by the config and
not by the number of layers.

With ``pinned=True`` the buffers are JAX ``pinned_host`` memory (page-locked on an accelerator),
so a copy between a staged slice and the device is a DMA the driver runs asynchronously, not a
copy through the runtime's own staging buffer. `staging_pinned` chooses: pinned on an accelerator
that has ``pinned_host``, anonymous mmap on the CPU backend (where the device is host memory and
reads land in the device buffer directly) or where the platform lacks it.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from zinfjax.store.errors import BufferBudgetError
from zinfjax.store.layout import host_memory_kind

_ALIGN = mmap.PAGESIZE


class HostBuffer:
    """One page-aligned host allocation handed out by a `BufferPool`.

    Attributes:
        nbytes: size of the buffer in bytes.
        memory: the whole buffer as a flat `uint8` numpy array.
    """

    def __init__(self, pool: BufferPool, nbytes: int):
        self._pool = pool
        self.nbytes = nbytes
        if pool.pinned:
            self._owner, self.memory = _pinned(nbytes, pool.device)
        else:  # anonymous mmap gives page alignment, which O_DIRECT and zero-copy transfers need
            self._owner = mmap.mmap(-1, max(nbytes, 1))
            self.memory = np.frombuffer(self._owner, dtype=np.uint8, count=nbytes)
        self.released = True

    @property
    def address(self) -> int:
        """The address of the first byte, to detect arrays that alias this buffer."""
        return self.memory.ctypes.data

    def contains(self, address: int) -> bool:
        """Whether `address` points into this buffer."""
        return self.address <= address < self.address + max(self.nbytes, 1)

    def view(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A typed view of `shape` and `dtype` starting `offset` bytes in."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.memory[offset : offset + count].view(dtype).reshape(shape)

    def release(self) -> None:
        """Returns the buffer to its pool; idempotent."""
        self._pool.release(self)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _pinned(nbytes: int, device) -> tuple[jax.Array, np.ndarray]:
    """A page-aligned ``nbytes`` of ``device``'s ``pinned_host`` memory: the JAX array that owns it, and a
    numpy view of it (the pool's chunk I/O reads and writes it in place; the array only keeps it alive)."""
    owner = jax.device_put(np.zeros(nbytes + _ALIGN, np.uint8), SingleDeviceSharding(device, memory_kind="pinned_host"))
    owner.block_until_ready()
    address = owner.unsafe_buffer_pointer()
    start = -address % _ALIGN
    view = np.ctypeslib.as_array((ctypes.c_uint8 * (nbytes + _ALIGN)).from_address(address))
    return owner, view[start : start + nbytes]


def staging_pinned(device) -> bool:
    """Whether a pool for ``device`` stages in pinned memory: on an accelerator with ``pinned_host``."""
    return device.platform != "cpu" and host_memory_kind(device)[0] == "pinned_host"


def staging_pool(capacity_bytes: int) -> BufferPool:
    """A pool for this process's first local device, pinned where `staging_pinned` says so.

    Example:
        >>> staging_pool(1 << 20).stats()["memory"]   # the CPU backend
        'pageable'
    """
    device = jax.local_devices()[0]
    return BufferPool(capacity_bytes, pinned=staging_pinned(device), device=device)


def aligned_size(nbytes: int) -> int:
    """`nbytes` rounded up to the pool's alignment, the stride of views packed into a buffer."""
    return -(-nbytes // 64) * 64


class BufferPool:
    """A thread-safe pool of host buffers bounded by `capacity_bytes`.

    `acquire` blocks until the bytes fit. Freed buffers are kept for reuse (page faults on fresh
    memory cost as much as a copy) but count against the capacity. A request takes the smallest
    kept buffer that holds it (counted at its own size), so slices of several sizes share the
    buffers (bf16 on NVMe writes 14, 28 and 56 MB slices a layer: matching sizes exactly dropped
    and faulted in a buffer per write, 1.2 core-s per step of gpt2-small against 0.5); kept
    buffers are dropped only when a new one needs the room.

    Args:
        capacity_bytes: the most host memory the pool may hold at once.
        pinned: buffers in ``device``'s ``pinned_host`` memory (default: anonymous mmap).
        device: the device whose pinned memory backs the buffers (default: the first).

    Example:
        >>> pool = BufferPool(64 << 20)
        >>> with pool.acquire(1 << 20) as buf:
        ...     buf.memory[:4] = 1
        >>> pool.in_use_bytes, pool.peak_bytes
        (0, 1048576)
    """

    def __init__(self, capacity_bytes: int, pinned: bool = False, device=None):
        if capacity_bytes <= 0:
            raise BufferBudgetError(f"host_buffer_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.pinned = pinned
        self.device = device or (jax.devices()[0] if pinned else None)
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self.acquires = 0
        self.waits = 0
        self._free: list[HostBuffer] = []
        self._free_bytes = 0
        self._cond = threading.Condition()

    @property
    def resident_bytes(self) -> int:
        """Bytes held by the pool: in use plus kept for reuse; never above the capacity."""
        return self.in_use_bytes + self._free_bytes

    def acquire(self, nbytes: int, timeout: float | None = None) -> HostBuffer:
        """Takes a buffer of `nbytes`, waiting until the pool has room.

        Raises:
            BufferBudgetError: if `nbytes` exceeds the whole capacity, since no wait could help.
            TimeoutError: if `timeout` seconds pass without room.
        """
        nbytes = int(nbytes)
        if nbytes > self.capacity_bytes:
            raise BufferBudgetError(
                f"the host buffer budget ({self.capacity_bytes} bytes) cannot hold one layer: "
                f"{nbytes} bytes are needed; raise host_buffer_bytes to at least {nbytes}"
            )
        with self._cond:
            if self.in_use_bytes + nbytes > self.capacity_bytes:
                self.waits += 1
            if not self._cond.wait_for(lambda: self.in_use_bytes + nbytes <= self.capacity_bytes, timeout):
                raise TimeoutError(f"no {nbytes} bytes free in the host buffer pool after {timeout} s")
            buf = self._take_free(nbytes)
            self.in_use_bytes += buf.nbytes if buf is not None else nbytes
            self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
            self.acquires += 1
        if buf is None:
            buf = HostBuffer(self, nbytes)
        buf.released = False
        return buf

    def release(self, buf: HostBuffer) -> None:
        """Returns `buf` to the pool and wakes waiters; releasing twice is a no-op."""
        with self._cond:
            if buf.released:
                return
            buf.released = True
            self.in_use_bytes -= buf.nbytes
            if self.resident_bytes + buf.nbytes <= self.capacity_bytes:
                self._free.append(buf)
                self._free_bytes += buf.nbytes
            self._cond.notify_all()

    def _take_free(self, nbytes: int) -> HostBuffer | None:
        """A kept buffer for ``nbytes``: the smallest that holds it and fits in the capacity beside those in use
        (a larger one serves a smaller request: a fresh buffer costs page faults), else None after dropping
        kept buffers until a new one fits."""
        room = self.capacity_bytes - self.in_use_bytes
        fits = [(buf.nbytes, k) for k, buf in enumerate(self._free) if nbytes <= buf.nbytes <= room]
        if fits:
            _, k = min(fits)
            buf = self._free.pop(k)
            self._free_bytes -= buf.nbytes
            return buf
        # Drop kept buffers of other sizes until the new allocation fits under the capacity.
        while self._free and self.resident_bytes + nbytes > self.capacity_bytes:
            self._free_bytes -= self._free.pop(0).nbytes
        return None

    def stats(self) -> dict[str, int]:
        """Counters for telemetry: capacity, in use, peak, acquires and acquires that waited."""
        with self._cond:
            return {
                "capacity_bytes": self.capacity_bytes,
                "in_use_bytes": self.in_use_bytes,
                "peak_bytes": self.peak_bytes,
                "resident_bytes": self.resident_bytes,
                "acquires": self.acquires,
                "waits": self.waits,
                "memory": "pinned_host" if self.pinned else "pageable",
            }
