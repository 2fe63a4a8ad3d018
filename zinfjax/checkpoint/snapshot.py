"""Taking a step's state out of its stores: hard links for nvme, array references for memory tiers.

`take` runs between two steps and returns at once: an nvme store's chunk files are hard-linked
into the checkpoint (a linked chunk is never overwritten in place afterwards, so the link keeps
this step's bytes), and a device or host store's arrays, which are immutable, are referenced.
`Snapshot.write` then makes the files durable, in a background thread while training goes on:
it fsyncs the linked chunks, copies those staged from another filesystem, and writes the
referenced arrays out, one chunk at a time: last layer first, the order in which the next step's
update replaces them, and each layer let go (`MemoryStore.saved`) as soon as it is written. A
store waits to replace a layer until then, so a save never holds a second copy of the device or
host state: at most the one chunk being copied to host memory.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil

import jax
import numpy as np

from zinfjax.checkpoint.format import leaf_metadata
from zinfjax.store import chunkfile
from zinfjax.store.manifest import fsync_dir
from zinfjax.store.nvme import aligned_empty, shard_grid
from zinfjax.store.split import pieces_of


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf of a checkpoint item: its directory name, orbax key path and zarr metadata.

    ``stacked``: the leaf is written one layer at a time (its chunks are layers).
    """

    item: str
    name: str
    keypath: tuple
    meta: dict
    stacked: bool = False


@dataclasses.dataclass
class Part:
    """One store's share of a checkpoint: its item, group and leaves (in the store's leaf order).

    ``stream`` says how the store's slices map to the leaves' rows (None: whole leaves). A part
    without a store holds ``arrays`` kept in memory (the optimizer's global state).
    """

    item: str
    group: str
    store: object
    leaves: list[Leaf]
    stream: object = None
    arrays: list | None = None
    streams: list | None = None  # each leaf's stream, where they differ (the leaves of a group of tiles)
    slots: list[int] | None = None  # each leaf's index among its store's leaves (None: the store's leaves in order)

    def stream_of(self, k: int):
        return self.streams[k] if self.streams is not None else self.stream

    def position(self, k: int) -> int | None:
        """Which of this part's leaves is the store's leaf ``k`` (None: the part does not save it)."""
        if self.slots is None:
            return k
        return self.slots.index(k) if k in self.slots else None


def leaf_name(path: str) -> str:
    """A leaf's directory name in a checkpoint item: its key path with dots (``blocks.fc.kernel``)."""
    return path.replace("/", ".")


def _chunk_shape(lay, stream) -> tuple:
    """The checkpoint chunk of a store leaf: one device shard of one slice (a layer keeps its axis of 1; a tile
    its layer's, and its tile's where the leaf stacks tiles)."""
    shard = tuple(lay.shard_shape)
    if stream is not None and stream.tiles and stream.axis is None:
        return (1, 1, *shard)
    return (1, *shard) if stream is not None and stream.rows == 0 else shard


def _part(item: str, group: str, store, entries: list, streams: dict) -> Part:
    """A part of the store leaves ``entries``: ``(store key, full shape, plain key path)``, cut as ``streams``
    (by store key) says; the store's other leaves are not saved."""
    by_key = {key: (shape, keys) for key, shape, keys in entries}
    order = [path for path, _ in _store_keys(store)]
    slots = [k for k, key in enumerate(order) if key in by_key]
    leaves = []
    for k in slots:
        key, lay = order[k], store.layouts[k]
        shape, keys = by_key[key]
        stream = streams[key]
        stacked = stream is not None and stream.rows == 0
        leaves.append(Leaf(item, leaf_name(key), keys, leaf_metadata(shape, lay.dtype, _chunk_shape(lay, stream)),
                           stacked))
    ordered = [streams[order[k]] for k in slots]
    return Part(item, group, store, leaves, ordered[0] if ordered else None, streams=ordered,
                slots=None if len(slots) == len(order) else slots)


def _store_keys(store) -> list:
    return [(str(path[0].key), x) for path, x in jax.tree_util.tree_flatten_with_path(store.like)[0]]


def parts_of(engine, frozen: frozenset = frozenset()) -> list[Part]:
    """Every part of a checkpoint: parameters (fp32 masters where they are kept, else the compute copy), optimizer
    state by group, and its globals; the leaves ``frozen`` names (a fine-tune's base, kept elsewhere) are not saved.
    """
    program, plan, s = engine.program, engine.update_plan, engine.stores
    parts = []
    for g in program.groups.values():
        leaves = [x for x in program.leaves_of(g.name) if x.index not in frozen]
        streams = {x.path: x.stream for x in leaves}
        master = (s.master or {}).get(g.name)
        mastered = [x for x in leaves if master is not None and x.path in master.like]
        rest = [x for x in leaves if x not in mastered]  # a frozen leaf without a master: its compute copy
        for store, chosen in ((master, mastered), (s.params.get(g.name), rest)):
            if chosen:
                parts.append(_part("params", g.name, store, [(x.path, x.shape, x.keys) for x in chosen], streams))
        state = plan.state_of(g.name)
        if state:  # in the user's layout: a tiled leaf's state has its parameter's shape
            entries = [(x.path, plan.user_shape(x), x.keys) for x in state]
            parts.append(_part("opt_state", g.name, s.opt[g.name], entries,
                               {x.path: program.leaves[x.param].stream for x in state}))
    glob = [Leaf("opt_state", leaf_name(x.path), x.keys, leaf_metadata(x.shape, x.dtype, x.shape))
            for x in plan.globals]
    if glob:
        parts.append(Part("opt_state", "globals", None, glob, None, [np.asarray(a) for a in engine.globals]))
    return parts


def chunk_index(stream, i: int, grid: tuple[int, ...], shard: tuple[int, ...], slice_shape: tuple[int, ...]):
    """The checkpoint chunk that holds slice ``i``'s shard at ``grid`` (grid over the slice's shape, in shards of
    ``shard``)."""
    if stream is None:
        return tuple(grid)
    if stream.tiles:
        layer, t = divmod(i, stream.tiles)
        if stream.axis is None:
            return (layer, t, *grid)
        a, at = stream.axis, list(grid)
        at[a] += t * (slice_shape[a] // shard[a])
        return (layer, *at)
    if stream.rows == 0:
        return (i, *grid)
    return (i * (stream.rows // (shard[0] if shard else 1)) + grid[0], *grid[1:])


class Snapshot:
    """One step's chunks on their way into a checkpoint directory (see the module docstring)."""

    def __init__(self, root: str, staging: str | None):
        self.root, self.staging = root, staging
        self.linked: list[str] = []
        self.staged: list[tuple[str, str]] = []  # (staged link, destination) across filesystems
        self.arrays: list[tuple[Part, object, int, list]] = []  # (part, store of one tier, its first layer, layers)
        self._dirs: set[str] = set()

    # ---- between two steps -------------------------------------------------------------------

    def take(self, parts: list[Part]) -> Snapshot:
        for part in parts:
            if part.store is None:
                self.arrays.append((part, None, 0, [part.arrays]))
                continue
            for first, store in pieces_of(part.store):  # a store split across tiers, one tier at a time
                if store.tier == "nvme":
                    self._link(part, store, first)
                else:
                    self.arrays.append((part, store, first, store.snapshot()))
        return self

    def _link(self, part: Part, store, first: int) -> None:
        for i in range(store.num_layers):
            for k, shard, src in store.chunk_files(i):
                lay, at = store.layouts[k], part.position(k)
                if at is None:
                    continue
                dst = self._chunk(part, at, chunk_index(part.stream_of(at), first + i, shard_grid(shard, lay),
                                                        lay.shard_shape, lay.layer_shape))
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

    def _chunk(self, part: Part, k: int, index) -> str:
        path = chunkfile.chunk_path(os.path.join(self.root, part.item, part.leaves[k].name), index)
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
        try:
            self._write_arrays()
        finally:
            self._let_go()

    def _write_arrays(self) -> None:
        """Every referenced layer, last first; each store may replace a layer once it is written."""
        for layer in reversed(range(max((first + len(layers) for _, _, first, layers in self.arrays), default=0))):
            for part, store, first, layers in self.arrays:
                i = layer - first
                if not 0 <= i < len(layers) or layers[i] is None:
                    continue
                for k, x in enumerate(layers[i]):
                    at = part.position(k)
                    if at is not None:
                        self._write_array(part, at, layer, x)
                layers[i] = None
                if store is not None:
                    store.saved(i)

    def _let_go(self) -> None:
        for _, store, _, _ in self.arrays:
            if store is not None:
                store.release_saves()
        self.arrays.clear()

    def discard(self) -> None:
        if self.staging:
            shutil.rmtree(self.staging, ignore_errors=True)
        self._let_go()

    def _write_array(self, part: Part, k: int, i: int, x) -> None:
        chunk, stream = part.leaves[k].meta["chunk_shape"], part.stream_of(k)
        chunk = tuple(chunk[len(chunk) - np.ndim(x):])  # less the layer's (and a stacked tile's) axis
        shards = x.addressable_shards if isinstance(x, jax.Array) else [_Whole(np.asarray(x))]
        for shard in shards:
            if shard.replica_id != 0:
                continue
            data = np.asarray(shard.data)
            grid = tuple((sl.start or 0) // n if n else 0 for sl, n in zip(shard.index, chunk, strict=True))
            nbytes = data.nbytes
            slot = aligned_empty((chunkfile.slot_bytes(nbytes),), np.uint8, chunkfile.BLOCK)
            slot[:nbytes] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            index = chunk_index(stream, i, grid, tuple(chunk), tuple(np.shape(x)))
            chunkfile.write_chunks([(self._chunk(part, k, index), slot, nbytes)], sync=True, atomic=True)


@dataclasses.dataclass
class _Whole:
    """A host array as one shard of itself (the global optimizer state)."""

    data: np.ndarray
    replica_id: int = 0

    @property
    def index(self) -> tuple:
        return tuple(slice(0, n) for n in self.data.shape)
