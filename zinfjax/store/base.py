"""The interface every tier implements, and the ordering it guarantees.

A `LayerStore` holds a pytree of stacked leaves `(L, ...)` and moves one layer at a time.
`write(i, tree)` and `read(i)` return futures. The base class keeps the one invariant all tiers
share: a read of layer `i` sees the last write of each of its leaves, even while that write is in
flight, and two writes of one leaf of a layer land in the order they were issued.

A store whose tree is a flat dict also moves part of a layer: ``read(i, keys)`` and
``write(i, part, keys)`` take the dict keys of some leaves (the engine updates a large layer a
few leaves at a time, so no more than those leaves' state is in memory at once).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import jax
import numpy as np

from zinfjax.store.errors import StoreError, StoreIOError, StoreSpaceError
from zinfjax.store.layout import LeafLayout, stacked_sharding


@dataclasses.dataclass
class StoreStats:
    """Counters of one store in this process.

    Attributes:
        bytes_read: bytes this process read from the tier.
        bytes_written: bytes this process wrote to the tier.
        reads: reads completed.
        writes: writes completed.
        reads_in_flight: reads issued and not yet complete.
        peak_reads_in_flight: the most reads that were in flight at once.
    """

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    reads_in_flight: int = 0
    peak_reads_in_flight: int = 0


def done_future(value) -> Future:
    """A future that has already completed with `value`."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


class LayerStore:
    """Base class of the device, host and nvme tiers.

    Subclasses implement `_start_write(i, leaves, after, ks)` and `_start_read(i, after, ks, memory_kind)`,
    which return futures, and may override `flush` and `close`. `ks` are the indices of the leaves
    moved (every leaf, or a part), `after` the futures of the last writes of those leaves of layer
    `i` (the order is kept per leaf, so a part is not held up by a write of another part); the
    subclass must not touch those leaves of layer `i` before they complete.

    Attributes:
        tier: "device", "host" or "nvme".
        memory_kind: the JAX memory kind the layers are held in (None for the nvme tier, which holds them on disk).
        like: the abstract stacked tree (`jax.ShapeDtypeStruct` leaves).
        layouts: one `LeafLayout` per leaf, in tree order.
        stats: a `StoreStats`.
    """

    tier = ""
    memory_kind: str | None = None

    def __init__(self, like, layouts: list[LeafLayout]):
        self.like = like
        self.layouts = layouts
        self._treedef = jax.tree_util.tree_structure(like)
        self._all = list(range(len(layouts)))
        flat = isinstance(like, dict) and all(isinstance(x, jax.ShapeDtypeStruct) for x in like.values())
        self._keys = sorted(like) if flat else None  # a flat dict's keys, in leaf order
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._last_write: dict[tuple[int, int], Future] = {}  # (layer, leaf) -> its last write
        self._writes: set[Future] = set()
        self._errors: list[BaseException] = []
        self._closed = False
        self._read_shardings: dict = {}

    def read_sharding(self, k: int, memory_kind: str):
        """Leaf ``k``'s per-layer sharding in ``memory_kind``, made once per (leaf, kind) rather than per read."""
        if memory_kind == "device":
            return self.layouts[k].sharding
        key = (k, memory_kind)
        if key not in self._read_shardings:
            self._read_shardings[key] = self.layouts[k].sharding.with_memory_kind(memory_kind)
        return self._read_shardings[key]

    @property
    def num_layers(self) -> int:
        """`L`, the number of layers."""
        return self.layouts[0].num_layers if self.layouts else 0

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one whole layer (all leaves, all shards)."""
        return sum(lay.layer_nbytes for lay in self.layouts)

    def tier_at(self, i: int) -> str:
        """The tier holding layer ``i``: the store's own, but in a split store (`zinfjax.store.split`)."""
        return self.tier

    def memory_kind_at(self, i: int) -> str | None:
        """The memory kind layer ``i`` is held in (None on NVMe): the store's own, but in a split store."""
        return self.memory_kind

    def drop_free_reads(self) -> None:
        """Lets go of read buffers kept for later reads that nothing uses now (the nvme tier on the CPU backend,
        `zinfjax.store.recycle`); nothing elsewhere."""

    def hands_over(self, i: int) -> bool:
        """Whether a computation may take over the buffers a read of layer ``i`` returns, its outputs being
        written back to this store right after: true for the nvme tier, whose reads are fresh buffers (except
        those it reads in place on the CPU backend, which XLA would copy before taking over), and for a tier in
        memory whose layer ``i`` no checkpoint snapshot holds (`zinfjax.store.memory.MemoryStore`).

        Example:
            >>> import jax, jax.numpy as jnp, tempfile
            >>> from zinfjax.store import open_store
            >>> like = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "b": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
            >>> host, nvme = open_store("host", like), open_store("nvme", like, path=tempfile.mkdtemp())
            >>> host.hands_over(3), nvme.hands_over(3)        # the arrays it holds; a fresh read from disk
            (True, False)
            >>> nvme.close()
        """
        return False

    def part_nbytes(self, keys=None) -> int:
        """Bytes of the leaves ``keys`` of one layer (all shards); every leaf when None."""
        return sum(self.layouts[k].layer_nbytes for k in self.leaf_indices(keys))

    def write(self, i: int, layer_tree, keys=None) -> Future:
        """Starts writing layer `i`; returns a future that completes (with None) once it is stored.

        Args:
            i: the layer index.
            layer_tree: a tree like `like` with axis 0 removed; leaves are jax.Arrays or numpy
                arrays. jax arrays are immutable; numpy arrays must not be changed until the future
                completes. With ``keys``, a dict of just those leaves.
            keys: the dict keys of the leaves written (a part of the layer); None writes them all.

        Example:
            >>> import jax, jax.numpy as jnp, tempfile
            >>> from zinfjax.store import open_store
            >>> like = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "b": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
            >>> store = open_store("nvme", like, path=tempfile.mkdtemp())
            >>> store.write(3, {"w": jnp.ones(8), "b": jnp.zeros(2)}).result()
            >>> store.write(3, {"w": jnp.full(8, 2.0)}, keys=["w"]).result()       # a part of the layer
            >>> store.read(3).result()["w"][0], store.read(3).result()["b"][0]
            (Array(2., dtype=float32), Array(0., dtype=float32))
            >>> store.close()
        """
        self._check_open()
        i = self._check_layer(i)
        ks = self.leaf_indices(keys)
        leaves = self._flatten_layer(layer_tree, ks, keys)
        with self._lock:
            fut = self._start_write(i, leaves, self._after(i, ks), ks)
            self._last_write.update(dict.fromkeys(((i, k) for k in ks), fut))
            self._writes.add(fut)
        fut.add_done_callback(lambda f, i=i, ks=ks: self._write_done(i, ks, f))
        return fut

    def read(self, i: int, keys=None, memory_kind: str = "device") -> Future:
        """Starts reading layer `i`; the future's result is the layer tree, on device.

        Its leaves are jax.Arrays in device memory with the per-layer sharding, whatever the tier.
        With ``keys`` (dict keys of some leaves), the result is a dict of just those leaves. With
        ``memory_kind="pinned_host"`` the arrays stay in host memory (the optimizer update on the
        host reads its state so): the host tier hands over what it holds, NVMe stages into host memory.

        Example:
            >>> import jax, jax.numpy as jnp, tempfile
            >>> from zinfjax.store import open_store
            >>> like = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "b": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
            >>> store = open_store("nvme", like, path=tempfile.mkdtemp())
            >>> store.write(3, {"w": jnp.ones(8), "b": jnp.zeros(2)}).result()
            >>> layer = store.read(3).result()
            >>> sorted(layer), sorted(store.read(3, keys=["w"]).result())               # all, or a part
            (['b', 'w'], ['w'])
            >>> store.close()
        """
        self._check_open()
        i = self._check_layer(i)
        ks = self.leaf_indices(keys)
        with self._lock:
            after = self._after(i, ks)
            self.stats.reads_in_flight += 1
            self.stats.peak_reads_in_flight = max(self.stats.peak_reads_in_flight, self.stats.reads_in_flight)
        fut = self._start_read(i, after, ks, memory_kind)
        fut.add_done_callback(self._read_done)
        return fut

    def write_all(self, stacked_tree) -> None:
        """Writes every layer of a stacked tree and waits for all of them.

        Example:
            >>> import jax, jax.numpy as jnp, tempfile
            >>> from zinfjax.store import open_store
            >>> like = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32), "b": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
            >>> store = open_store("host", like)
            >>> store.write_all({"w": jnp.ones((4, 8)), "b": jnp.zeros((4, 2))})       # every layer of a stacked tree
            >>> float(store.read(3).result()["w"].sum())
            8.0
        """
        leaves = self._treedef.flatten_up_to(stacked_tree)
        futures = [
            self.write(i, self._treedef.unflatten([x[i] for x in leaves])) for i in range(self.num_layers)
        ]
        for fut in futures:
            fut.result()

    def read_all(self):
        """Reads every layer and stacks them: a tree like `like` on device (needs the whole tree's memory)."""
        layers = [self._treedef.flatten_up_to(self.read(i).result()) for i in range(self.num_layers)]
        stacked = [
            jax.device_put(_stack_bits([layer[k] for layer in layers]), stacked_sharding(lay.sharding))
            for k, lay in enumerate(self.layouts)
        ]
        return self._unflatten(stacked)

    def flush(self) -> None:
        """Waits for every write in flight; raises the first error any write hit since the last flush."""
        with self._lock:
            pending = list(self._writes)
        for fut in pending:
            fut.exception()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Flushes, then releases the tier's resources; idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_write(self, i: int, leaves: list, after: list[Future], ks: list[int]) -> Future:
        raise NotImplementedError

    def _start_read(self, i: int, after: list[Future], ks: list[int], memory_kind: str) -> Future:
        raise NotImplementedError

    def _after(self, i: int, ks: list[int]) -> list[Future]:
        """The writes in flight that the leaves ``ks`` of layer ``i`` must wait for (call under the lock)."""
        return list({id(f): f for k in ks if (f := self._last_write.get((i, k))) is not None}.values())

    def _release(self) -> None:
        """Frees tier resources after the final flush."""

    def _unflatten(self, leaves: list, ks: list[int] | None = None):
        if ks is None or ks == self._all:
            return self._treedef.unflatten(leaves)
        return {self._keys[k]: x for k, x in zip(ks, leaves, strict=True)}

    def leaf_indices(self, keys) -> list[int]:
        """The leaf indices of ``keys`` in leaf order (every leaf for None)."""
        if keys is None:
            return self._all
        if self._keys is None:
            raise StoreError("only a store whose tree is a flat dict moves part of a layer")
        unknown = set(keys) - set(self._keys)
        if unknown or not keys:
            raise StoreError(f"keys {sorted(unknown) or '[]'} name no leaf of this store; it holds {self._keys}")
        return sorted(self._keys.index(key) for key in set(keys))

    def _write_done(self, i: int, ks: list[int], fut: Future) -> None:
        with self._lock:
            self._writes.discard(fut)
            for k in ks:
                if self._last_write.get((i, k)) is fut and fut.exception() is None:
                    del self._last_write[(i, k)]
            if fut.exception() is not None:
                self._errors.append(fut.exception())
            else:
                self.stats.writes += 1

    def _read_done(self, fut: Future) -> None:
        with self._lock:
            self.stats.reads_in_flight -= 1
            if fut.exception() is None:
                self.stats.reads += 1

    def _flatten_layer(self, layer_tree, ks: list[int], keys=None) -> list:
        if keys is None:
            try:
                leaves = self._treedef.flatten_up_to(layer_tree)
            except (ValueError, TypeError) as e:
                raise StoreError(f"the layer tree does not match the store's tree: {e}") from e
        else:
            names = [self._keys[k] for k in ks]
            if not isinstance(layer_tree, dict) or sorted(layer_tree) != names:
                got = sorted(layer_tree) if isinstance(layer_tree, dict) else type(layer_tree).__name__
                raise StoreError(f"a part written as keys {names} holds {got}")
            leaves = [layer_tree[name] for name in names]
        for lay, x in zip([self.layouts[k] for k in ks], leaves, strict=True):
            if tuple(np.shape(x)) != lay.layer_shape or np.dtype(x.dtype) != lay.dtype:
                raise StoreError(
                    f"leaf {lay.name!r}: got {np.dtype(x.dtype).name}{list(np.shape(x))}, the store holds "
                    f"{lay.dtype.name}{list(lay.layer_shape)} per layer"
                )
        return leaves

    def _check_layer(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} is out of range for a store of {self.num_layers} layers")
        return i

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the {self.tier} store is closed")


def _stack_bits(xs: list) -> jax.Array:
    """Stacks arrays bit-exactly: floats go through unsigned ints, whose copies keep every NaN payload."""
    dtype = xs[0].dtype
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return jax.numpy.stack(xs)
    as_uint = jax.numpy.dtype(f"uint{8 * dtype.itemsize}")
    bits = jax.numpy.stack([jax.lax.bitcast_convert_type(x, as_uint) for x in xs])
    return jax.lax.bitcast_convert_type(bits, dtype)


def close_all(stores) -> None:
    """Closes every store of ``stores``, then raises the first failure any of them hit."""
    errors = []
    for store in stores:
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - close every store, then report the first failure
            errors.append(e)
    if errors:
        raise errors[0]


def wait_after(i: int, after: list[Future]) -> None:
    """Blocks until the previous writes of layer `i` are done; re-raises a failure as a StoreError.

    A read must not return older data than a write that failed, so the failure propagates.
    """
    for fut in after:
        error = fut.exception()
        if isinstance(error, (StoreIOError, StoreSpaceError)):  # the disk's own failure, one line already: as it is
            raise type(error)(str(error)) from error
        if error is not None:
            raise StoreError(f"layer {i}: its last write failed, so it cannot be read: {error}") from error
