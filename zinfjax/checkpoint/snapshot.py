"""Taking a step's state out of its stores: hard links for nvme, array references for memory tiers.

`take` runs between two steps and returns at once: an nvme store's chunk files are hard-linked
into the checkpoint (a linked chunk is never overwritten in place afterwards, so the link keeps
this step's bytes), and a device or host store's arrays, which are immutable, are referenced.
`Snapshot.write` then makes the files durable, in a background thread while training goes on:
it fsyncs the linked chunks, copies those staged from another filesystem, and writes the
referenced arrays out, one chunk at a time.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil

import jax
import numpy as np

from zinfjax.checkpoint.format import key_path, leaf_metadata
from zinfjax.store import chunkfile
from zinfjax.store.manifest import fsync_dir
from zinfjax.store.nvme import aligned_empty, shard_grid


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a checkpoint item: its directory name, orbax key path and zarr metadata."""

    item: str
    name: str
    keypath: tuple
    meta: dict


@dataclasses.dataclass
class Part:
    """One store's share of a checkpoint: the item and group it fills, and its leaves."""

    item: str
    group: str
    store: object
    leaves: list[Leaf]


def parts_of(engine) -> list[Part]:
    """Every store a checkpoint holds: parameters (the fp32 masters, if any) and optimizer state."""
    s = engine.stores
    sources = [("params", s.master or s.params), ("opt_state", s.opt)]
    return [Part(item, g, stores[g], leaves_of(stores[g], item, g)) for item, stores in sources for g in stores]


def leaves_of(store, item: str, group: str) -> list[Leaf]:
    """The checkpoint leaves of a store: blocks keep their layer axis, embed and head drop theirs."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(store.like)[0]]
    out = []
    for path, lay in zip(paths, store.layouts, strict=True):
        stacked = group == "blocks"
        shape = (lay.num_layers, *lay.layer_shape) if stacked else lay.layer_shape
        chunk = (1, *lay.shard_shape) if stacked else lay.shard_shape
        out.append(Leaf(item, f"{group}.{lay.name}", key_path(group, path), leaf_metadata(shape, lay.dtype, chunk)))
    return out


def chunk_index(part: Part, i: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    return (i, *grid) if part.group == "blocks" else tuple(grid)


class Snapshot:
    """One step's chunks on their way into a checkpoint directory (see the module docstring)."""

    def __init__(self, root: str, staging: str | None):
        self.root, self.staging = root, staging
        self.linked: list[str] = []
        self.staged: list[tuple[str, str]] = []  # (staged link, destination) across filesystems
        self.arrays: list[tuple[Part, list]] = []
        self._dirs: set[str] = set()

    # ---- between two steps -------------------------------------------------------------------

    def take(self, parts: list[Part]) -> Snapshot:
        for part in parts:
            if part.store.tier == "nvme":
                self._link(part)
            else:
                self.arrays.append((part, part.store.snapshot()))
        return self

    def _link(self, part: Part) -> None:
        store = part.store
        for i in range(store.num_layers):
            for k, shard, src in store.chunk_files(i):
                dst = self._chunk(part, k, i, shard_grid(shard, store.layouts[k]))
                if self.staged or not self._try_link(src, dst):
                    staged = os.path.join(self.staging, os.path.relpath(dst, self.root))
                    self._makedirs(os.path.dirname(staged))
                    self._link_once(src, staged)
                    self.staged.append((staged, dst))

    def _try_link(self, src: str, dst: str) -> bool:
        try:
            self._link_once(src, dst)
        except OSError as e:
            if e.errno == errno.EXDEV and self.staging:  # another filesystem: stage beside the store
                return False
            raise
        self.linked.append(dst)
        return True

    @staticmethod
    def _link_once(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except FileExistsError:  # a shard replicated over processes: the first link serves all
            pass

    def _chunk(self, part: Part, k: int, i: int, grid) -> str:
        path = chunkfile.chunk_path(os.path.join(self.root, part.item, part.leaves[k].name),
                                    chunk_index(part, i, grid))
        self._makedirs(os.path.dirname(path))
        return path

    def _makedirs(self, d: str) -> None:
        if d not in self._dirs:
            os.makedirs(d, exist_ok=True)
            self._dirs.add(d)

    # ---- in the background -------------------------------------------------------------------

    def write(self) -> None:
        """Makes every chunk durable under the checkpoint directory."""
        for path in self.linked:
            fsync_dir(path)
        for staged, dst in self.staged:
            shutil.copyfile(staged, dst)  # in the kernel (sendfile / copy_file_range)
            fsync_dir(dst)
        if self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)
        for part, layers in self.arrays:
            for i, leaves in enumerate(layers):
                for k, x in enumerate(leaves):
                    self._write_array(part, k, i, x)
        self.arrays.clear()

    def discard(self) -> None:
        if self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)
        self.arrays.clear()

    def _write_array(self, part: Part, k: int, i: int, x: jax.Array) -> None:
        chunk = part.leaves[k].meta["chunk_shape"]
        chunk = chunk[1:] if part.group == "blocks" else chunk
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            data = np.asarray(shard.data)
            grid = tuple((sl.start or 0) // n if n else 0 for sl, n in zip(shard.index, chunk, strict=True))
            nbytes = data.nbytes
            slot = aligned_empty((chunkfile.slot_bytes(nbytes),), np.uint8, chunkfile.BLOCK)
            slot[:nbytes] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            chunkfile.write_chunks([(self._chunk(part, k, i, grid), slot, nbytes)], sync=True, atomic=True)
