"""The interface every tier implements, and the ordering it guarantees.

A `LayerStore` holds a pytree of stacked leaves `(L, ...)` and moves one layer at a time.
`write(i, tree)` and `read(i)` return futures. The base class keeps the one invariant all tiers
share: a read of layer `i` sees the last write of layer `i`, even while that write is in flight,
and two writes of one layer land in the order they were issued.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import jax
import numpy as np

from zinfjax.store.errors import StoreError
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

    Subclasses implement `_start_write(i, leaves, after)` and `_start_read(i, after)`, which
    return futures, and may override `flush` and `close`. `after` is the future of the last write
    of layer `i` (or None); the subclass must not touch layer `i` before it completes.

    Attributes:
        tier: "device", "host" or "nvme".
        like: the abstract stacked tree (`jax.ShapeDtypeStruct` leaves).
        layouts: one `LeafLayout` per leaf, in tree order.
        stats: a `StoreStats`.
    """

    tier = ""

    def __init__(self, like, layouts: list[LeafLayout]):
        self.like = like
        self.layouts = layouts
        self._treedef = jax.tree_util.tree_structure(like)
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._last_write: dict[int, Future] = {}
        self._writes: set[Future] = set()
        self._errors: list[BaseException] = []
        self._closed = False

    @property
    def num_layers(self) -> int:
        """`L`, the number of layers."""
        return self.layouts[0].num_layers if self.layouts else 0

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one whole layer (all leaves, all shards)."""
        return sum(lay.layer_nbytes for lay in self.layouts)

    def write(self, i: int, layer_tree) -> Future:
        """Starts writing layer `i`; returns a future that completes (with None) once it is stored.

        Args:
            i: the layer index.
            layer_tree: a tree like `like` with axis 0 removed; leaves are jax.Arrays or numpy
                arrays. jax arrays are immutable; numpy arrays must not be changed until the future
                completes.

        Example:
            >>> store.write(3, layer).result()  # doctest: +SKIP
        """
        self._check_open()
        i = self._check_layer(i)
        leaves = self._flatten_layer(layer_tree)
        with self._lock:
            fut = self._start_write(i, leaves, self._last_write.get(i))
            self._last_write[i] = fut
            self._writes.add(fut)
        fut.add_done_callback(lambda f, i=i: self._write_done(i, f))
        return fut

    def read(self, i: int) -> Future:
        """Starts reading layer `i`; the future's result is the layer tree, on device.

        Its leaves are jax.Arrays in device memory with the per-layer sharding, whatever the tier.

        Example:
            >>> layer = store.read(3).result()  # doctest: +SKIP
        """
        self._check_open()
        i = self._check_layer(i)
        with self._lock:
            after = self._last_write.get(i)
            self.stats.reads_in_flight += 1
            self.stats.peak_reads_in_flight = max(self.stats.peak_reads_in_flight, self.stats.reads_in_flight)
        fut = self._start_read(i, after)
        fut.add_done_callback(self._read_done)
        return fut

    def write_all(self, stacked_tree) -> None:
        """Writes every layer of a stacked tree and waits for all of them.

        Example:
            >>> store.write_all(params["blocks"])  # doctest: +SKIP
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

    def _start_write(self, i: int, leaves: list, after: Future | None) -> Future:
        raise NotImplementedError

    def _start_read(self, i: int, after: Future | None) -> Future:
        raise NotImplementedError

    def _release(self) -> None:
        """Frees tier resources after the final flush."""

    def _unflatten(self, leaves: list):
        return self._treedef.unflatten(leaves)

    def _write_done(self, i: int, fut: Future) -> None:
        with self._lock:
            self._writes.discard(fut)
            if self._last_write.get(i) is fut and fut.exception() is None:
                del self._last_write[i]
            if fut.exception() is not None:
                self._errors.append(fut.exception())
            else:
                self.stats.writes += 1

    def _read_done(self, fut: Future) -> None:
        with self._lock:
            self.stats.reads_in_flight -= 1
            if fut.exception() is None:
                self.stats.reads += 1

    def _flatten_layer(self, layer_tree) -> list:
        try:
            leaves = self._treedef.flatten_up_to(layer_tree)
        except (ValueError, TypeError) as e:
            raise StoreError(f"the layer tree does not match the store's tree: {e}") from e
        for lay, x in zip(self.layouts, leaves, strict=True):
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


def wait_after(i: int, after: Future | None) -> None:
    """Blocks until the previous write of layer `i` is done; re-raises its failure as a StoreError.

    A read must not return older data than a write that failed, so the failure propagates.
    """
    if after is None:
        return
    error = after.exception()
    if error is not None:
        raise StoreError(f"layer {i}: its last write failed, so it cannot be read: {error}") from error
