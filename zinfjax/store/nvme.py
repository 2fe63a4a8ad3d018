"""The nvme tier: one tensorstore zarr3 array per leaf, one chunk per (layer, device shard).

Each chunk is raw little-endian bytes followed by a crc32c checksum, checked on every read. The
`file` kvstore writes a chunk to a temporary file and renames it into place, so a chunk is either
the old or the new one, never half of each. Reads and writes stage through host buffers from a
`BufferPool`, run on small thread pools, and hand back futures.

On the CPU backend, where device memory is host memory, direct reads skip the staging buffer:
each chunk is read with O_DIRECT straight into the aligned array that becomes its device
buffer (``device_put`` adopts it without a copy), which saves a copy of every byte read.
"""

from __future__ import annotations

import os
from concurrent.futures import Future

import jax
import numpy as np
import tensorstore as ts
from jax.sharding import SingleDeviceSharding

from zinfjax.store import chunkfile, manifest
from zinfjax.store.base import LayerStore, wait_after
from zinfjax.store.disk import check_free_space, free_bytes, is_disk_full, prepare_directory
from zinfjax.store.errors import (
    LayerNotWrittenError,
    ManifestMismatchError,
    StoreCorruptionError,
    StoreError,
    StoreIOError,
    StorePathError,
    StoreSpaceError,
    StoreUsageError,
)
from zinfjax.store.layout import LeafLayout, Shard
from zinfjax.store.lock import StoreLock
from zinfjax.store.pool import BufferPool, HostBuffer
from zinfjax.store.recycle import ReadBuffers, aligned_bytes
from zinfjax.store.threads import executor

CHECKSUM_BYTES = chunkfile.CHECKSUM_BYTES
CHUNK_IO = ("direct", "tensorstore")
# How tensorstore reports a chunk whose bytes are wrong: a checksum mismatch (DATA_LOSS), or a
# file too short or malformed to decode.
_CORRUPTION_SIGNS = (
    "DATA_LOSS",
    "igest",
    "ecod",
    "Not enough data",
    "FAILED_PRECONDITION",
    "INVALID_ARGUMENT",
)
DEFAULT_FILE_IO_CONCURRENCY = 32


def tensorstore_context(
    file_io_concurrency: int = DEFAULT_FILE_IO_CONCURRENCY,
    file_io_sync: bool = True,
    file_io_locking: str = "os",
    file_io_mode: str = "default",
    data_copy_concurrency: int = 4,
) -> ts.Context:
    """The tensorstore context the nvme tier opens its arrays with.

    Args:
        file_io_concurrency: how many file operations tensorstore runs at once.
        file_io_sync: fsync each chunk (and its directory) before a write completes.
        file_io_locking: "os", "lockfile", "none" or "non_atomic" (see tensorstore's file kvstore).
        file_io_mode: "default", "memmap" or "direct" (O_DIRECT reads).
        data_copy_concurrency: threads that checksum and copy chunk data.
    """
    spec = {
        "file_io_concurrency": {"limit": file_io_concurrency},
        "data_copy_concurrency": {"limit": data_copy_concurrency},
        "file_io_sync": file_io_sync,
        "file_io_locking": {"mode": file_io_locking},
        "file_io_mode": {"mode": file_io_mode} if file_io_mode != "default" else {},
    }
    return ts.Context(spec)


def zarr_spec(path: str, lay: LeafLayout) -> dict:
    """The zarr3 spec of one leaf: chunk = (1 layer, 1 device shard), raw bytes + crc32c."""
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": path},
        "metadata": {
            "shape": [lay.num_layers, *lay.layer_shape],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *lay.shard_shape]}},
            "data_type": lay.dtype.name,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
        # A missing chunk means the layer was never written: say so instead of returning zeros,
        # and store all-zero layers too, so that rule holds for them.
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
    }


class NvmeStore(LayerStore):
    """The nvme tier, rooted at one directory.

    Args:
        like: the abstract stacked tree.
        layouts: one `LeafLayout` per leaf.
        directory: the store directory (`<nvme_path>/<name>`).
        pool: the host buffer pool for staging; one is made (4 layers) when None.
        create: create the store when the directory holds none.
        read_threads: reads that can run at once.
        write_threads: writes that can run at once.
        chunk_io: "direct" reads and writes the zarr3 chunk files itself (O_DIRECT, hardware
            crc32c; see `chunkfile`); "tensorstore" goes through tensorstore's read and write.
            Both give the same files.
        atomic: with direct chunk I/O, False overwrites existing chunks in place instead of
            through a temporary file and a rename (see `chunkfile.write_chunks`): for scratch
            state, such as the engine's working copy, that a crash invalidates anyway.
        in_place: leaves (by their key in ``like``) read where they already are: the zarr3 array
            directory of a checkpoint's leaf whose chunks are this store's (one layer each, the
            same dtype and codecs). They are read-only: a write to one is refused.
        replace: a store found under ``directory`` with other shapes or layers (a run with another model, or
            another split of its layers, `zinfjax.store.split`) is deleted and made afresh instead of refused:
            for scratch state, which a run writes whole before it reads any.
        verify: check each chunk's crc32c as it is read (direct chunk I/O); False trusts the disk and
            memory (the checksum is still written). tensorstore's reads always check it.
        reuse_reads: on the CPU backend, read a chunk into an array of an earlier read that nothing holds any
            more (`zinfjax.store.recycle`) instead of a fresh one; False for the fresh one every time.
        **context: options for `tensorstore_context`; ``file_io_sync`` applies to both.
    """

    tier = "nvme"

    def __init__(
        self,
        like,
        layouts: list[LeafLayout],
        directory: str,
        pool: BufferPool | None = None,
        *,
        create: bool = True,
        read_threads: int = 8,
        write_threads: int = 4,
        chunk_io: str = "direct",
        atomic: bool = True,
        in_place: dict[str, str] | None = None,
        replace: bool = False,
        verify: bool = True,
        reuse_reads: bool = True,
        **context,
    ):
        super().__init__(like, layouts)
        keys = [str(p[0].key) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
        self.in_place = {k: os.path.abspath(in_place[key]) for k, key in enumerate(keys) if key in (in_place or {})}
        if chunk_io not in CHUNK_IO:
            raise StoreUsageError(f"chunk_io={chunk_io!r} is not allowed; use one of {', '.join(CHUNK_IO)}")
        self.chunk_io = chunk_io
        self._sync = context.get("file_io_sync", True)
        self._atomic = atomic
        self._replace = replace
        self.verify = verify
        self.directory = os.path.abspath(directory)
        prepare_directory(self.directory)
        self._lock_file = StoreLock(self.directory)
        self._lock_file.acquire()
        try:
            self._leaf_dirs = [self.in_place.get(k, os.path.join(self.directory, lay.name))
                               for k, lay in enumerate(self.layouts)]
            self._arrays = self._open(create, tensorstore_context(**context))
        except BaseException:
            self._lock_file.release()
            raise
        self.pool = pool or BufferPool(max(4 * self._read_nbytes(), 64 << 20))
        self._read_buffers = ReadBuffers(reuse=reuse_reads)  # the CPU backend's read arrays
        # Reads land in place, in arrays XLA adopts, with direct chunk I/O on the CPU backend (`_read_in_place`).
        self._in_place_reads = chunk_io == "direct" and all(
            d.platform == "cpu" for lay in self.layouts for s in lay.shards for d in s.devices)
        self._readers = executor(read_threads, f"zinf-read-{os.path.basename(directory)}")
        self._writers = executor(write_threads, f"zinf-write-{os.path.basename(directory)}")

    def _open(self, create: bool, context: ts.Context) -> list[ts.TensorStore]:
        expected = manifest.build(os.path.basename(self.directory), self.layouts)
        try:
            found = manifest.read(self.directory)
        except StoreError:
            if not self._replace:
                raise
            found = {}  # scratch state whose manifest was damaged: made afresh, as a mismatched one
        if found is not None and self._replace and not manifest.matches(self.directory, found, expected):
            manifest.clear(self.directory, keep=self._lock_file.path)
            found = None
        if found is not None:
            manifest.check(self.directory, found, expected)
        elif not create:
            raise StorePathError(
                f"no store at {self.directory} (no {manifest.MANIFEST}); open it with create=True"
            )
        else:
            written = [k for k in range(len(self.layouts)) if k not in self.in_place]
            check_free_space(self.directory, self.num_layers * self._write_nbytes(CHECKSUM_BYTES, written))
        arrays = [self._open_leaf(lay, context, k) for k, lay in enumerate(self.layouts)]
        if found is None:
            manifest.write(self.directory, expected)
        return arrays

    def _open_leaf(self, lay: LeafLayout, context: ts.Context, k: int) -> ts.TensorStore:
        try:
            if k in self.in_place:
                return ts.open(zarr_spec(self._leaf_dirs[k], lay), open=True, read=True, context=context).result()
            return ts.open(
                zarr_spec(self._leaf_dirs[k], lay),
                create=True,
                open=True,
                context=context,
            ).result()
        except ValueError as e:
            raise ManifestMismatchError(
                f"store {self.directory}: leaf {lay.name!r} on disk does not match "
                f"{lay.dtype.name}{[lay.num_layers, *lay.layer_shape]}: {e}; "
                "use a fresh nvme_path or delete it"
            ) from e

    def _write_nbytes(self, extra: int = 0, ks: list[int] | None = None) -> int:
        layouts = self.layouts if ks is None else [self.layouts[k] for k in ks]
        return sum(lay.shard_nbytes + extra for lay in layouts for s in lay.shards if s.writer)

    def _read_nbytes(self) -> int:
        return sum(
            chunkfile.slot_bytes(lay.shard_nbytes) for lay in self.layouts for s in lay.shards if s.devices
        )

    def _start_write(self, i: int, leaves: list, after: list[Future], ks: list[int]) -> Future:
        shut = [k for k in ks if k in self.in_place]
        if shut:
            raise StoreUsageError(f"store {self.directory}: leaf {self.layouts[shut[0]].name} is read-only (opened in "
                                  f"place at {self._leaf_dirs[shut[0]]})")
        return self._writers.submit(self._write_layer, i, leaves, after, ks)

    def drop_free_reads(self) -> None:
        self._read_buffers.drop_free()

    def hands_over(self, i: int) -> bool:
        """Every read is a fresh buffer of its own (never the pool's, never the file's): a computation may take it
        over, except where it was read in place (direct chunk I/O on the CPU backend, `_read_in_place`). XLA
        cannot take over memory it adopted: it copies a donated array of it into a fresh buffer first, on the
        thread that runs the computation, so an update donating Adam's m and v of 64 MB each took 77 ms against
        34 ms without donating them (and 10 ms with arrays of XLA's own)."""
        return not self._in_place_reads

    def _start_read(self, i: int, after: list[Future], ks: list[int], memory_kind: str) -> Future:
        return self._readers.submit(self._read_layer, i, after, ks, memory_kind)

    def _write_layer(self, i: int, leaves: list, after: list[Future], ks: list[int]) -> None:
        for fut in after:
            fut.exception()  # only the order matters: this write replaces that one either way
        plan = [(k, s) for k in ks for s in self.layouts[k].shards if s.writer]
        buf = self.pool.acquire(sum(self._slot(k) for k, _ in plan))
        try:
            host = {k: _on_layer_sharding(x, self.layouts[k]) for k, x in zip(ks, leaves, strict=True)}
            for x in host.values():  # on an accelerator every leaf's copy to the host starts now, not in turn
                if isinstance(x, jax.Array) and next(iter(x.devices())).platform != "cpu":
                    for shard in x.addressable_shards:
                        shard.data.copy_to_host_async()
            slots = self._slots(plan, buf)
            for (k, shard), (slot, view) in zip(plan, slots, strict=True):
                if self.chunk_io == "direct":  # the copy and its checksum together (`chunkfile.stage`)
                    chunkfile.stage(slot, _host_shard(host[k], shard), self.layouts[k].shard_nbytes)
                else:
                    np.copyto(view, _host_shard(host[k], shard))
            # The staged copy is what gets written: let the layer's arrays go now, not when it lands.
            del host
            leaves.clear()
            if self.chunk_io == "direct":
                self._write_direct(i, plan, slots)
            else:
                self._write_tensorstore(i, plan, slots)
        finally:
            buf.release()
        self._count("bytes_written", self._write_nbytes(ks=ks))

    def _write_direct(self, i: int, plan: list, slots: list) -> None:
        chunks = [
            (self._chunk_path(k, i, s), slot, self.layouts[k].shard_nbytes)
            for (k, s), (slot, _) in zip(plan, slots, strict=True)
        ]
        try:
            chunkfile.write_chunks(chunks, sync=self._sync, atomic=self._atomic, checksummed=True)
        except chunkfile.ChunkWriteError as e:
            raise self._translate(e, i, self.layouts[plan[e.chunk][0]], writing=True) from e

    def _write_tensorstore(self, i: int, plan: list, slots: list) -> None:
        pending = [
            (k, self._arrays[k][(i, *s.index)].write(view)) for (k, s), (_, view) in zip(plan, slots, strict=True)
        ]
        for k, fut in pending:
            self._wait(fut, i, self.layouts[k], writing=True)

    def _read_layer(self, i: int, after: list[Future], ks: list[int], memory_kind: str):
        wait_after(i, after)
        plan = [(k, s) for k in ks for s in self.layouts[k].shards if s.devices]
        if self._in_place_reads:
            out = self._read_in_place(i, plan, ks, memory_kind)
        else:
            out = self._read_staged(i, plan, ks, memory_kind)
        self._count("bytes_read", sum(lay.shard_nbytes for k, s in plan for lay in [self.layouts[k]]))
        return self._unflatten(out, ks)

    def _read_staged(self, i: int, plan: list, ks: list[int], memory_kind: str) -> list:
        buf = self.pool.acquire(sum(self._slot(k) for k, _ in plan))
        try:
            slots = self._slots(plan, buf)
            if self.chunk_io == "direct":
                self._read_direct(i, plan, slots)
            else:
                self._read_tensorstore(i, plan, slots)
            return self._to_device(plan, [view for _, view in slots], buf, ks, memory_kind)
        finally:
            buf.release()

    def _read_in_place(self, i: int, plan: list, ks: list[int], memory_kind: str) -> list:
        """CPU backend: every chunk read into its own aligned array, which its device array then owns; an array
        whose last device array is gone serves a later read (`ReadBuffers`), so its pages are not zeroed anew."""
        slots = self._read_buffers.take([self._slot(k) for k, _ in plan], chunkfile.BLOCK)
        self._read_direct(i, plan, [(slot, None) for slot in slots])
        per_leaf: dict[int, list] = {k: [] for k in ks}
        for slot, (k, shard) in zip(slots, plan, strict=True):
            lay = self.layouts[k]
            view = slot[: lay.shard_nbytes].view(lay.dtype).reshape(lay.shard_shape)
            first, *others = shard.devices
            per_leaf[k].append(jax.device_put(view, _target(first, memory_kind)))
            per_leaf[k].extend(_device_put(view, d, memory_kind) for d in others)  # a copy each: devices never alias
        return [
            jax.make_array_from_single_device_arrays(self.layouts[k].layer_shape,
                                                     self.read_sharding(k, memory_kind), xs)
            for k, xs in per_leaf.items()
        ]

    def _read_direct(self, i: int, plan: list, slots: list) -> None:
        chunks = [
            (self._chunk_path(k, i, s), slot, self.layouts[k].shard_nbytes)
            for (k, s), (slot, _) in zip(plan, slots, strict=True)
        ]
        try:
            chunkfile.read_chunks(chunks, verify=self.verify)
        except (ValueError, OSError) as e:
            raise self._translate(e, i, self.layouts[plan[getattr(e, "chunk", 0)][0]], writing=False) from e

    def _read_tensorstore(self, i: int, plan: list, slots: list) -> None:
        futures = [
            ts.array(view, copy=False).write(self._arrays[k][(i, *s.index)])
            for (_, view), (k, s) in zip(slots, plan, strict=True)
        ]
        for fut, (k, _) in zip(futures, plan, strict=True):
            self._wait(fut, i, self.layouts[k], writing=False)

    def _chunk_path(self, k: int, i: int, shard: Shard) -> str:
        return chunkfile.chunk_path(self._leaf_dirs[k], (i, *shard_grid(shard, self.layouts[k])))

    def chunk_files(self, i: int) -> list[tuple[int, Shard, str]]:
        """Layer ``i``'s chunk files this process wrote: ``(leaf index, shard, path)`` each.

        Checkpoints link them (zinfjax/checkpoint): a linked chunk is never overwritten in
        place, so the link keeps the layer as it was (see `chunkfile.write_chunks`).
        """
        return [(k, s, self._chunk_path(k, i, s)) for k, lay in enumerate(self.layouts) for s in lay.shards
                if s.writer]

    def _slot(self, k: int) -> int:
        return chunkfile.slot_bytes(self.layouts[k].shard_nbytes)

    def _slots(self, plan: list, buf: HostBuffer) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per chunk: its block-aligned slot in `buf` and the typed view of its data."""
        slots, offset = [], 0
        for k, _ in plan:
            lay = self.layouts[k]
            slot = buf.memory[offset : offset + self._slot(k)]
            slots.append((slot, buf.view(offset, lay.shard_shape, lay.dtype)))
            offset += self._slot(k)
        return slots

    def _to_device(self, plan: list, views: list, buf: HostBuffer, ks: list[int], memory_kind: str) -> list:
        per_leaf: dict[int, list] = {k: [] for k in ks}
        for view, (k, shard) in zip(views, plan, strict=True):
            per_leaf[k].extend(_device_put(view, d, memory_kind) for d in shard.devices)
        return [
            jax.make_array_from_single_device_arrays(self.layouts[k].layer_shape,
                                                     self.read_sharding(k, memory_kind),
                                                     [_detach(x, buf) for x in xs])
            for k, xs in per_leaf.items()
        ]

    def _wait(self, fut, i: int, lay: LeafLayout, *, writing: bool) -> None:
        try:
            fut.result()
        except (ValueError, OSError) as e:
            raise self._translate(e, i, lay, writing) from e

    def _translate(self, e: Exception, i: int, lay: LeafLayout, writing: bool) -> StoreError:
        msg = str(e)
        where = f"leaf {lay.name!r}, layer {i} of store {self.directory}"
        if writing and is_disk_full(e):
            need = self._write_nbytes(CHECKSUM_BYTES)
            return StoreSpaceError(
                f"disk full writing {where}: the layer needs {need} bytes, "
                f"{free_bytes(self.directory)} are free; "
                "free some space or use another nvme_path (layers already written remain readable)"
            )
        if not writing and ("NOT_FOUND" in msg or isinstance(e, FileNotFoundError)):
            return LayerNotWrittenError(f"{where} was read before it was ever written")
        corrupt = isinstance(e, chunkfile.ChunkCorruptError) or any(sign in msg for sign in _CORRUPTION_SIGNS)
        if not writing and corrupt:
            return StoreCorruptionError(f"corrupt chunk in {where}: {msg}", leaf=lay.name, layer=i)
        if isinstance(e, OSError) and e.errno is not None:  # the disk failed it (EIO, a read-only remount...)
            return StoreIOError(f"NVMe {'write' if writing else 'read'} failed: [Errno {e.errno}] "
                                f"{e.strerror or os.strerror(e.errno)}: {e.filename or lay.name} "
                                f"(layer {i} of leaf {lay.name!r} in store {self.directory})")
        return StoreError(f"{'writing' if writing else 'reading'} {where} failed: {msg}")

    def _count(self, field: str, nbytes: int) -> None:
        with self._lock:
            setattr(self.stats, field, getattr(self.stats, field) + nbytes)

    def _release(self) -> None:
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self._read_buffers.clear()
        self._lock_file.release()


def _on_layer_sharding(x, lay: LeafLayout):
    if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(lay.sharding, len(lay.layer_shape)):
        return jax.device_put(x, lay.sharding)
    return x


def _host_shard(x, shard: Shard) -> np.ndarray:
    if isinstance(x, jax.Array):
        by_device = {s.device: s for s in x.addressable_shards}
        return np.asarray(by_device[shard.devices[0]].data)
    return np.asarray(x)[shard.index]


def _target(device, memory_kind: str):
    """Where ``device_put`` puts a shard: ``device`` itself, or its ``memory_kind`` memory (``pinned_host``)."""
    return device if memory_kind == "device" else SingleDeviceSharding(device, memory_kind=memory_kind)


def _device_put(view: np.ndarray, device, memory_kind: str = "device") -> jax.Array:
    """Copies a pool view to `device` (its ``memory_kind`` memory), never leaving the result aliasing the pool.

    On the CPU backend `device_put` of 64-byte-aligned host memory is zero-copy, so the view is
    copied into a private aligned array that the device array then owns: one memcpy, where a
    device-side copy of an aliasing array would cost two.
    """
    if device.platform != "cpu":
        return jax.device_put(view, _target(device, memory_kind))
    private = aligned_empty(view.shape, view.dtype)
    np.copyto(private, view)
    return jax.device_put(private, _target(device, memory_kind))


def shard_grid(shard: Shard, lay: LeafLayout) -> tuple[int, ...]:
    """The chunk-grid coordinates of ``shard`` within one layer of ``lay``."""
    shape = lay.shard_shape
    return tuple((sl.start or 0) // n if n else 0 for sl, n in zip(shard.index, shape, strict=True))


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    return aligned_bytes(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, align).view(dtype).reshape(shape)


def _detach(x: jax.Array, buf: HostBuffer) -> jax.Array:
    """`x`, copied if it aliases `buf`, so the buffer can go back to the pool.

    On the CPU backend `device_put` of an aligned numpy array can be zero-copy.
    """
    x.block_until_ready()
    if buf.contains(x.unsafe_buffer_pointer()):
        x = x.copy()
        x.block_until_ready()
    return x
