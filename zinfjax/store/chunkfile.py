"""Chunk files of the nvme tier, read and written directly, in zarr3's own encoding.

A zarr3 chunk whose codecs are ``bytes`` (little endian) then ``crc32c`` is a file holding the
chunk's raw bytes followed by their crc32c, 4 bytes little endian, at ``<leaf>/c/<i>/<j>/...``.
tensorstore reads and writes exactly these files, so an array written here opens and reads in
tensorstore (and any zarr3 reader) unchanged, and the other way round.

Doing the chunk I/O here rather than through tensorstore's read path saves most of its CPU cost,
which is what bounds a 2-core machine: reads go straight from the disk into a page-aligned pool
buffer with ``O_DIRECT`` (no page-cache copy, no fresh allocation), and the checksum is the
hardware crc32c of ``google-crc32c`` instead of a portable one. Writes are atomic: a temporary
file in the chunk's directory, ``fsync``, then ``rename`` over the old chunk.

Example:
    >>> slot = np.zeros(slot_bytes(8), np.uint8)
    >>> slot[:8] = np.arange(8)
    >>> write_chunks([("/tmp/zf/c/0", slot, 8)])
    >>> read_chunk("/tmp/zf/c/0", np.empty(slot_bytes(8), np.uint8), 8)[:8].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

import errno
import os
import threading
import uuid

import numpy as np
from google_crc32c import cext as _crc32c

CHECKSUM_BYTES = 4
BLOCK = 4096  # O_DIRECT needs buffers, offsets and lengths aligned to the logical block size
_DIRECT = getattr(os, "O_DIRECT", 0)
_no_direct: set[int] = set()  # st_dev of filesystems that refused O_DIRECT (tmpfs, some overlays)
_no_direct_lock = threading.Lock()


class ChunkCorruptError(ValueError):
    """A chunk file whose size or checksum is wrong."""


class ChunkWriteError(OSError):
    """An OSError while writing chunk number `chunk` of a `write_chunks` call (errno kept)."""

    def __init__(self, chunk: int, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.chunk = chunk


def slot_bytes(nbytes: int) -> int:
    """Bytes a buffer slot needs for a chunk of `nbytes`: data, checksum, padding to `BLOCK`."""
    return -(-(nbytes + CHECKSUM_BYTES) // BLOCK) * BLOCK


def chunk_path(leaf_dir: str, index: tuple[int, ...]) -> str:
    """The file of chunk `index` under zarr3's default chunk key encoding (``c/i/j/...``)."""
    return os.path.join(leaf_dir, "c", *(str(int(i)) for i in index))


def crc32c(data: np.ndarray) -> int:
    """The crc32c of a contiguous array's bytes (hardware accelerated where the CPU has it)."""
    view = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = view.view()
    view.flags.writeable = False  # the C extension takes read-only buffers only
    return _crc32c.value(view)


def read_chunk(path: str, slot: np.ndarray, nbytes: int) -> np.ndarray:
    """Reads the chunk at `path` into `slot` (uint8, `slot_bytes(nbytes)` long; page aligned for O_DIRECT).

    Returns:
        ``slot[:nbytes]``, the chunk's bytes, after their checksum was verified.

    Raises:
        FileNotFoundError: no chunk was ever written there.
        ChunkCorruptError: the file has the wrong size or its checksum does not match.
    """
    fd = _open(path, os.O_RDONLY, direct=_aligned(slot))
    try:
        size = os.fstat(fd).st_size
        if size != nbytes + CHECKSUM_BYTES:
            raise ChunkCorruptError(f"chunk file {path} holds {size} bytes, expected {nbytes + CHECKSUM_BYTES}")
        _read_into(fd, memoryview(slot)[: slot_bytes(nbytes)], size)
    finally:
        os.close(fd)
    stored = int.from_bytes(slot[nbytes : nbytes + CHECKSUM_BYTES].tobytes(), "little")
    actual = crc32c(slot[:nbytes])
    if stored != actual:
        raise ChunkCorruptError(f"crc32c mismatch in chunk file {path}: stored {stored:#010x}, computed {actual:#010x}")
    return slot[:nbytes]


def write_chunks(chunks: list[tuple[str, np.ndarray, int]], sync: bool = True) -> None:
    """Writes chunks atomically: each ``(path, slot, nbytes)`` holds its data in ``slot[:nbytes]``.

    Every chunk goes to a temporary file first; only when all are written (and, with `sync`,
    fsynced) are they renamed into place, so a failure (disk full, say) leaves every chunk as it
    was and no temporary file behind.
    """
    temps: list[str] = []
    try:
        for k, (path, slot, nbytes) in enumerate(chunks):
            try:
                temps.append(_write_temp(path, slot, nbytes, sync))
            except OSError as e:
                raise ChunkWriteError(k, e) from e
    except BaseException:
        for temp in temps:
            _unlink_quietly(temp)
        raise
    for temp, (path, _, _) in zip(temps, chunks, strict=True):
        os.replace(temp, path)
    if sync:
        for directory in {os.path.dirname(path) for path, _, _ in chunks}:
            _fsync_dir(directory)


def _write_temp(path: str, slot: np.ndarray, nbytes: int, sync: bool) -> str:
    slot[nbytes : nbytes + CHECKSUM_BYTES] = np.frombuffer(
        crc32c(slot[:nbytes]).to_bytes(CHECKSUM_BYTES, "little"), np.uint8
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd, direct = _open_for_write(temp, direct=_aligned(slot))
    try:
        size = nbytes + CHECKSUM_BYTES
        # O_DIRECT writes whole blocks; the padding past the checksum is cut off again.
        _write_all(fd, memoryview(slot)[: slot_bytes(nbytes) if direct else size])
        if direct:
            os.ftruncate(fd, size)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(temp)
        raise
    os.close(fd)
    return temp


def _aligned(slot: np.ndarray) -> bool:
    """Whether O_DIRECT can use `slot`: it must start on a block boundary."""
    return slot.ctypes.data % BLOCK == 0


def _open(path: str, flags: int, direct: bool) -> int:
    """Opens with O_DIRECT where asked and the filesystem allows it, buffered otherwise."""
    if direct and _DIRECT and _device_of(path) not in _no_direct:
        try:
            return os.open(path, flags | _DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _remember_no_direct(path)
    return os.open(path, flags)


def _open_for_write(temp: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if direct and _DIRECT and _device_of(os.path.dirname(temp)) not in _no_direct:
        try:
            return os.open(temp, flags | _DIRECT, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _unlink_quietly(temp)
            _remember_no_direct(os.path.dirname(temp))
    return os.open(temp, flags, 0o644), False


def _device_of(path: str) -> int:
    try:
        return os.stat(path).st_dev
    except OSError:
        return -1


def _remember_no_direct(path: str) -> None:
    with _no_direct_lock:
        _no_direct.add(_device_of(path))


def _read_into(fd: int, buf: memoryview, size: int) -> None:
    done = 0
    while done < size:
        got = os.preadv(fd, [buf[done:]], done)
        if got == 0:
            raise ChunkCorruptError(f"chunk file ended after {done} of {size} bytes")
        done += got


def _write_all(fd: int, buf: memoryview) -> None:
    done = 0
    while done < len(buf):
        done += os.pwritev(fd, [buf[done:]], done)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
