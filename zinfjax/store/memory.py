"""The device and host tiers: layers kept as jax.Arrays in a JAX memory kind.

The device tier keeps each layer in memory kind `device`; the host tier keeps it in
`pinned_host` and copies it to the device on read (on the CPU backend, where device memory is host
memory, it keeps it in `device` memory and copies nothing: `host_tier_kind`). Both hand back
futures so callers treat every tier alike, but the work is JAX's asynchronous dispatch, so the
futures complete at once.

The engine's update takes over the buffers of the layer it updates (`hands_over`: JAX buffer
donation) and writes its outputs back at once, so the new state reuses the old state's memory.

A checkpoint takes a `snapshot` of the layers (immutable arrays) and writes them out in the
background. So that the old and the new state are not both held, a write of a layer the
checkpoint has not saved yet waits until it has (`saved`): a save costs one layer in flight, not a
second copy of the state.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import jax
import numpy as np

from zinfjax.store.base import LayerStore, done_future, wait_after
from zinfjax.store.errors import LayerNotWrittenError
from zinfjax.store.layout import LeafLayout, host_tier_kind, with_memory_kind


def placed(x, sharding):
    """``x`` in ``sharding``: ``x`` itself when it is there already (a device_put would hand it back too, at
    a cost per leaf of every read and write), else a device_put."""
    if isinstance(x, jax.Array) and x.committed and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


class MemoryStore(LayerStore):
    """A tier that holds every layer as jax.Arrays in one memory kind.

    Args:
        like: the abstract stacked tree.
        layouts: one `LeafLayout` per leaf.
        memory_kind: "device" or "pinned_host".
    """

    def __init__(self, like, layouts: list[LeafLayout], memory_kind: str):
        super().__init__(like, layouts)
        self.memory_kind = memory_kind
        self._held = [with_memory_kind(lay.sharding, memory_kind) for lay in layouts]
        self._layers: list[list | None] = [None] * self.num_layers
        self._saving: dict[int, threading.Event] = {}  # layer -> set once a checkpoint has saved it

    def _start_write(self, i: int, leaves: list, after: list[Future], ks: list[int]) -> Future:
        saving = self._saving.get(i)
        if saving is not None:  # a checkpoint still holds this layer: it lands first, then is let go
            saving.wait()
        held = list(self._layers[i] or [None] * len(self.layouts))  # a new list: snapshots keep the old one
        for k, x in zip(ks, leaves, strict=True):
            held[k] = self._place(x, self._held[k])
        self._layers[i] = held
        self.stats.bytes_written += sum(self.layouts[k].layer_nbytes for k in ks)
        return done_future(None)

    def _start_read(self, i: int, after: list[Future], ks: list[int], memory_kind: str) -> Future:
        try:
            wait_after(i, after)
            held = self._layers[i]
            if held is None or any(held[k] is None for k in ks):
                raise LayerNotWrittenError(
                    f"layer {i} of the {self.tier} store was read before it was written"
                )
            out = [placed(held[k], self.read_sharding(k, memory_kind)) for k in ks]
        except Exception as e:  # noqa: BLE001 - every failure belongs in the future
            fut: Future = Future()
            fut.set_exception(e)
            return fut
        self.stats.bytes_read += sum(self.layouts[k].layer_nbytes for k in ks)
        return done_future(self._unflatten(out, ks))

    def hands_over(self, i: int) -> bool:
        """A read hands out the held arrays themselves (or copies of them): an update may take them over
        when it writes its outputs back at once, unless a checkpoint still saves layer ``i``."""
        return i not in self._saving

    def snapshot(self) -> list[list]:
        """Every layer's arrays as they are now. They are immutable, so a later write does not change them.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from zinfjax.store import open_store
            >>> store = open_store("host", {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32)})
            >>> store.write_all({"w": jnp.zeros((2, 4))})
            >>> layers = store.snapshot()   # a checkpoint writes these out while training goes on
            >>> store.hands_over(0)         # a read of layer 0 hands out copies now, not the arrays saved
            False
            >>> float(layers[0][0].sum())
            0.0
        """
        self.flush()
        self.release_saves()
        layers = [list(leaves) if leaves is not None else None for leaves in self._layers]
        self._saving = {i: threading.Event() for i, leaves in enumerate(layers) if leaves is not None}
        return layers

    def saved(self, i: int) -> None:
        """The checkpoint has written layer ``i`` (and dropped its arrays): a write of it may go on."""
        saving = self._saving.pop(i, None)
        if saving is not None:
            saving.set()

    def release_saves(self) -> None:
        """Every layer of the last snapshot may be written again (the save ended, or failed)."""
        saving, self._saving = self._saving, {}
        for event in saving.values():
            event.set()

    @staticmethod
    def _place(x, sharding):
        if isinstance(x, np.ndarray):
            # device_put may alias an aligned numpy array on the CPU backend; the caller may reuse
            # its array, so the store keeps a private copy.
            x = np.array(x, copy=True)
        return placed(x, sharding)

    def _release(self) -> None:
        self.release_saves()
        self._layers = [None] * self.num_layers


class DeviceStore(MemoryStore):
    """The device tier: layers stay in device memory."""

    tier = "device"

    def __init__(self, like, layouts: list[LeafLayout]):
        super().__init__(like, layouts, "device")


class HostStore(MemoryStore):
    """The host tier: layers in pinned host memory, copied to the device on read.

    ``memory_kind`` defaults to `host_tier_kind`: ``device`` on the CPU backend, where device memory is
    host memory and a read needs no copy; elsewhere ``pinned_host``, or ``unpinned_host`` on a platform
    without it.
    """

    tier = "host"

    def __init__(self, like, layouts: list[LeafLayout], memory_kind: str | None = None):
        device = next(iter(layouts[0].sharding.device_set)) if layouts else None
        super().__init__(like, layouts, memory_kind or host_tier_kind(device)[0])
