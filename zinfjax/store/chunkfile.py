"""Chunk files of the nvme tier, read and written directly, in zarr3's own encoding.

A zarr3 chunk whose codecs are ``bytes`` (little endian) then ``crc32c`` is a file holding the
chunk's raw bytes followed by their crc32c, 4 bytes little endian, at ``<leaf>/c/<i>/<j>/...``.
tensorstore reads and writes exactly these files, so an array written here opens and reads in
tensorstore (and any zarr3 reader) unchanged, and the other way round.

Doing the chunk I/O here rather than through tensorstore's read path saves most of its CPU cost,
which is what bounds a 2-core machine: reads go straight from the disk into a page-aligned pool
buffer with ``O_DIRECT`` (no page-cache copy, no fresh allocation), and the checksum is the
hardware crc32c of the ``crc32c`` package (SSE4.2 on three streams at once, and it releases the
GIL) instead of a portable one. Writes are atomic: a temporary
file in the chunk's directory, ``fsync``, then ``rename`` over the old chunk.

A call reads or writes many chunks at once (one layer's leaves), split into segments of
`SEGMENT` bytes issued together on a shared pool of `IO_THREADS` threads: a deep queue, as
``fio --iodepth=16`` measures the disk, where one request at a time would get about half.

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
from concurrent.futures import Future, ThreadPoolExecutor

import crc32c as _crc32c
import numpy as np

from zinfjax.store.threads import executor

CHECKSUM_BYTES = 4
BLOCK = 4096  # O_DIRECT needs buffers, offsets and lengths aligned to the logical block size
_DIRECT = getattr(os, "O_DIRECT", 0)
_no_direct: set[int] = set()  # st_dev of filesystems that refused O_DIRECT (tmpfs, some overlays)
_no_direct_lock = threading.Lock()
SEGMENT = 4 << 20  # bytes of one request; a multiple of BLOCK
IO_THREADS = 16  # requests in flight, over every store of the process
STAGE_PIECE = 1 << 20  # `stage` checksums and copies this much at a time: it stays in the core's cache
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class ChunkCorruptError(ValueError):
    """A chunk file whose size or checksum is wrong."""


class ChunkWriteError(OSError):
    """An OSError while writing chunk number `chunk` of a `write_chunks` call (errno kept)."""

    def __init__(self, chunk: int, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause), getattr(cause, "filename", None))
        self.chunk = chunk


def slot_bytes(nbytes: int) -> int:
    """Bytes a buffer slot needs for a chunk of `nbytes`: data, checksum, padding to `BLOCK`."""
    return -(-(nbytes + CHECKSUM_BYTES) // BLOCK) * BLOCK


def chunk_path(leaf_dir: str, index: tuple[int, ...]) -> str:
    """The file of chunk `index` under zarr3's default chunk key encoding (``c/i/j/...``)."""
    return os.path.join(leaf_dir, "c", *(str(int(i)) for i in index))


def crc32c(data: np.ndarray) -> int:
    """The crc32c of a contiguous array's bytes (hardware accelerated where the CPU has it)."""
    return _crc32c.crc32c(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def read_chunk(path: str, slot: np.ndarray, nbytes: int) -> np.ndarray:
    """Reads the chunk at `path` into `slot` (uint8, `slot_bytes(nbytes)` long; page aligned for O_DIRECT).

    Returns:
        ``slot[:nbytes]``, the chunk's bytes, after their checksum was verified.

    Raises:
        FileNotFoundError: no chunk was ever written there.
        ChunkCorruptError: the file has the wrong size or its checksum does not match.
    """
    return read_chunks([(path, slot, nbytes)])[0]


def read_chunks(chunks: list[tuple[str, np.ndarray, int]], verify: bool = True) -> list[np.ndarray]:
    """Reads every ``(path, slot, nbytes)`` at once (see `read_chunk`); returns their data views.

    ``verify=False`` skips the checksum (the file's size is still checked): for a caller that
    has chosen to trust the disk (the ``verify_chunks`` key, `zinfjax.sections.Tiering`).

    Raises:
        FileNotFoundError, ChunkCorruptError, OSError: as `read_chunk`, with ``.chunk`` set to the
        index of the chunk that failed.
    """
    fds: list[int] = []
    try:
        jobs = []
        for k, (path, slot, nbytes) in enumerate(chunks):
            with _naming(k):
                fd = _open(path, os.O_RDONLY, direct=_aligned(slot))
                fds.append(fd)
                size = os.fstat(fd).st_size
                if size != nbytes + CHECKSUM_BYTES:
                    raise ChunkCorruptError(f"chunk file {path} holds {size} bytes, expected {nbytes + CHECKSUM_BYTES}")
            buf = memoryview(slot)[: slot_bytes(nbytes)]
            jobs += [(k, _read_segment, fd, buf, offset, min(length, size - offset))
                     for offset, length in _segments(len(buf)) if offset < size]
        _run_all(jobs)
    except OSError as e:
        if getattr(e, "chunk", None) is not None and not e.filename:
            e.filename = chunks[e.chunk][0]  # the error names the chunk's file
        raise
    finally:
        for fd in fds:
            os.close(fd)
    if not verify:
        return [slot[:nbytes] for _, slot, nbytes in chunks]
    out = []
    for k, (path, slot, nbytes) in enumerate(chunks):
        stored = int.from_bytes(slot[nbytes : nbytes + CHECKSUM_BYTES].tobytes(), "little")
        actual = crc32c(slot[:nbytes])
        if stored != actual:
            with _naming(k):
                raise ChunkCorruptError(
                    f"crc32c mismatch in chunk file {path}: stored {stored:#010x}, computed {actual:#010x}")
        out.append(slot[:nbytes])
    return out


def write_chunks(chunks: list[tuple[str, np.ndarray, int]], sync: bool = True, atomic: bool = True,
                 checksummed: bool = False) -> None:
    """Writes chunks: each ``(path, slot, nbytes)`` holds its data in ``slot[:nbytes]``, and with ``checksummed``
    its crc32c after them already (`stage`); without, the checksum is computed here.

    Atomic (the default): every chunk goes to a temporary file first; only when all are written
    (and, with `sync`, fsynced) are they renamed into place, so a failure (disk full, say) leaves
    every chunk as it was and no temporary file behind.

    ``atomic=False`` overwrites a chunk file of the right size in place, which spares the file
    system an inode created and one freed per chunk (the larger part of a write's CPU cost on
    ext4). A write cut short leaves a chunk whose checksum no longer matches, which a read
    reports; it suits scratch state that a crash invalidates anyway. A chunk that does not exist
    yet, or whose file has another hard link (a checkpoint's), is written atomically.

    Raises:
        ChunkWriteError: naming the chunk that failed, with the OSError's errno.
    """
    try:
        if not checksummed:
            for _, slot, nbytes in chunks:
                _put_checksum(slot, nbytes)
        if atomic:
            _write_atomic(chunks, sync)
            return
        rest = _overwrite_in_place(chunks, sync)
        try:
            if rest:
                _write_atomic([chunks[k] for k in rest], sync)
        except ChunkWriteError as e:
            e.chunk = rest[e.chunk]
            raise
    except ChunkWriteError as e:
        e.filename = e.filename or chunks[e.chunk][0]  # the error names the chunk's file
        raise


def _write_atomic(chunks: list[tuple[str, np.ndarray, int]], sync: bool) -> None:
    temps: list[tuple[str, int, bool]] = []  # (temp path, fd, direct)
    try:
        jobs = []
        for k, (path, slot, nbytes) in enumerate(chunks):
            try:
                temp, fd, direct = _open_temp(path, slot, nbytes)
            except OSError as e:
                raise ChunkWriteError(k, e) from e
            temps.append((temp, fd, direct))
            buf = memoryview(slot)[: slot_bytes(nbytes) if direct else nbytes + CHECKSUM_BYTES]
            jobs += [(k, _write_segment, fd, buf, offset, length) for offset, length in _segments(len(buf))]
        _run_all(jobs, writing=True)
        _run_all([(k, _finish_temp, fd, nbytes + CHECKSUM_BYTES, direct, sync)
                  for k, ((_, fd, direct), (_, _, nbytes)) in enumerate(zip(temps, chunks, strict=True))],
                 writing=True)
    except BaseException:
        for temp, fd, _ in temps:
            _close_quietly(fd)
            _unlink_quietly(temp)
        raise
    for (temp, fd, _), (path, _, _) in zip(temps, chunks, strict=True):
        os.close(fd)
        os.replace(temp, path)
    if sync:
        _run_all([(k, _fsync_dir, d) for k, d in enumerate({os.path.dirname(p) for p, _, _ in chunks})], writing=True)


def _overwrite_in_place(chunks: list[tuple[str, np.ndarray, int]], sync: bool) -> list[int]:
    """Overwrites every chunk whose file exists with the right size; returns the indices of the others."""
    rest, jobs, fds = [], [], []
    try:
        for k, (path, slot, nbytes) in enumerate(chunks):
            size = nbytes + CHECKSUM_BYTES
            try:
                st = os.stat(path)
                # A chunk linked elsewhere (a checkpoint) is replaced, never overwritten: the link keeps it.
                if st.st_size != size or st.st_nlink > 1:
                    raise FileNotFoundError(path)
            except FileNotFoundError:
                rest.append(k)
                continue
            body = size // BLOCK * BLOCK if _aligned(slot) else 0  # whole blocks, O_DIRECT
            try:
                if body:
                    fd = _open(path, os.O_WRONLY, direct=True)
                    fds.append(fd)
                    jobs += [(k, _write_segment, fd, memoryview(slot)[:body], o, n) for o, n in _segments(body)]
                if body < size:  # the tail (or all of it) through the page cache: never past the end
                    fd = os.open(path, os.O_WRONLY)
                    fds.append(fd)
                    jobs.append((k, _write_segment, fd, memoryview(slot)[:size], body, size - body))
            except OSError as e:
                raise ChunkWriteError(k, e) from e
        _run_all(jobs, writing=True)
        if sync:
            _run_all([(0, os.fsync, fd) for fd in fds], writing=True)
    finally:
        for fd in fds:
            _close_quietly(fd)
    return rest


def stage(slot: np.ndarray, source: np.ndarray, nbytes: int) -> None:
    """Copies ``source``'s ``nbytes`` into ``slot`` (uint8) and puts their crc32c after them, for `write_chunks`
    with ``checksummed=True``. A piece at a time: the checksum reads each piece from memory and the copy from the
    cache, where a copy then a checksum of the whole reads it from memory twice (0.078 against 0.109 core-s per
    GB here).

    Example:
        >>> slot = np.zeros(slot_bytes(8), np.uint8)
        >>> stage(slot, np.arange(2, dtype=np.float32), 8)
        >>> bytes(slot[8:12]) == crc32c(np.arange(2, dtype=np.float32)).to_bytes(4, "little")
        True
    """
    flat = np.ascontiguousarray(source).reshape(-1).view(np.uint8)
    value = 0
    for start in range(0, nbytes, STAGE_PIECE):
        piece = flat[start : start + STAGE_PIECE]
        value = _crc32c.crc32c(piece, value)
        slot[start : start + len(piece)] = piece
    slot[nbytes : nbytes + CHECKSUM_BYTES] = np.frombuffer(value.to_bytes(CHECKSUM_BYTES, "little"), np.uint8)


def _put_checksum(slot: np.ndarray, nbytes: int) -> None:
    slot[nbytes : nbytes + CHECKSUM_BYTES] = np.frombuffer(
        crc32c(slot[:nbytes]).to_bytes(CHECKSUM_BYTES, "little"), np.uint8
    )


def _open_temp(path: str, slot: np.ndarray, nbytes: int) -> tuple[str, int, bool]:
    """Opens a fresh temporary file beside `path` for `slot` (its checksum after its data already)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd, direct = _open_for_write(temp, direct=_aligned(slot))
    return temp, fd, direct


def _finish_temp(fd: int, size: int, direct: bool, sync: bool) -> None:
    if direct:  # O_DIRECT writes whole blocks; the padding past the checksum is cut off again
        os.ftruncate(fd, size)
    if sync:
        os.fsync(fd)


def _segments(length: int) -> list[tuple[int, int]]:
    return [(offset, min(SEGMENT, length - offset)) for offset in range(0, length, SEGMENT)]


def _read_segment(fd: int, buf: memoryview, offset: int, need: int) -> None:
    """Reads ``buf[offset:]`` up to the segment's end; at least `need` bytes must come (the file may end)."""
    end, done = min(offset + SEGMENT, len(buf)), 0
    while done < need:
        got = os.preadv(fd, [buf[offset + done : end]], offset + done)
        if got == 0:
            raise ChunkCorruptError(f"chunk file ended {need - done} bytes early")
        done += got


def _write_segment(fd: int, buf: memoryview, offset: int, length: int) -> None:
    done = 0
    while done < length:
        done += os.pwritev(fd, [buf[offset + done : offset + length]], offset + done)


def _io_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = executor(IO_THREADS, "zinf-chunk-io")
        return _pool


def _run_all(jobs: list[tuple], writing: bool = False) -> None:
    """Runs ``(chunk, fn, *args)`` jobs on the I/O pool; waits for all, then raises the first failure."""
    if len(jobs) == 1:
        futures = [_done(jobs[0][1], *jobs[0][2:])]
    else:
        pool = _io_pool()
        futures = [pool.submit(fn, *args) for _, fn, *args in jobs]
    for (k, *_), future in zip(jobs, futures, strict=True):
        e = future.exception()
        if e is None:
            continue
        if writing and isinstance(e, OSError):
            raise ChunkWriteError(k, e) from e
        e.chunk = k
        raise e


def _done(fn, *args) -> Future:
    """Runs ``fn`` here; a finished future of its result (one job needs no thread hop)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 - handed on to the caller through the future
        future.set_exception(e)
    return future


class _naming:
    """Sets ``.chunk`` on an exception leaving the block."""

    def __init__(self, k: int):
        self.k = k

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if value is not None:
            value.chunk = self.k
        return False


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


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
