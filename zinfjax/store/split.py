"""A store whose layers are split across tiers: each run of layers in a store of its own tier.

``SplitStore`` holds pieces, ``(first layer, store)``, and sends each read and write of layer ``i`` to the piece
that holds it, as that piece's layer ``i - first``. Each piece keeps the ordering of its own layers (every layer
lives in one piece), so the split store keeps the tiers' one invariant (`zinfjax.store.base`) unchanged.

Example:
    >>> import jax, jax.numpy as jnp, tempfile
    >>> from zinfjax.store import open_store
    >>> like = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    >>> store = open_store("host:2,nvme", like, path=tempfile.mkdtemp())    # layers 0-1 in memory, 2-3 on disk
    >>> store.tier_at(0), store.tier_at(3)
    ('host', 'nvme')
    >>> store.write(3, {"w": jnp.ones(8)}).result(); float(store.read(3).result()["w"].sum())
    8.0
    >>> store.close()
"""

from __future__ import annotations

import bisect
from concurrent.futures import Future

from zinfjax.store.base import LayerStore, StoreStats, close_all
from zinfjax.store.layout import LeafLayout


class SplitStore(LayerStore):
    """Layers ``[first, next first)`` of each piece in that piece's store (see the module docstring).

    Attributes:
        tier: the split as the config spells it (``"host:12,nvme"``).
        pieces: ``(first layer, store)``, in layer order.
    """

    memory_kind = None

    def __init__(self, like, layouts: list[LeafLayout], pieces: list[tuple[int, LayerStore]], tier: str):
        super().__init__(like, layouts)
        self.pieces = pieces
        self.tier = tier
        self._firsts = [first for first, _ in pieces]

    @property
    def stats(self) -> StoreStats:
        """Every piece's counters summed."""
        out = StoreStats()
        for _, store in self.pieces:
            for name, value in vars(store.stats).items():
                setattr(out, name, getattr(out, name) + value)
        return out

    @stats.setter
    def stats(self, _value) -> None:  # the base class sets one; the pieces keep the counts
        pass

    def piece(self, i: int) -> tuple[LayerStore, int]:
        """The store holding layer ``i``, and the layer's index there."""
        i = self._check_layer(i)
        first, store = self.pieces[bisect.bisect_right(self._firsts, i) - 1]
        return store, i - first

    def tier_at(self, i: int) -> str:
        return self.piece(i)[0].tier

    def memory_kind_at(self, i: int) -> str | None:
        return self.piece(i)[0].memory_kind

    def hands_over(self, i: int) -> bool:
        store, j = self.piece(i)
        return store.hands_over(j)

    def write(self, i: int, layer_tree, keys=None) -> Future:
        self._check_open()
        store, j = self.piece(i)
        return store.write(j, layer_tree, keys)

    def read(self, i: int, keys=None, memory_kind: str = "device") -> Future:
        self._check_open()
        store, j = self.piece(i)
        return store.read(j, keys, memory_kind)

    def flush(self) -> None:
        for _, store in self.pieces:
            store.flush()

    def drop_free_reads(self) -> None:
        for _, store in self.pieces:
            store.drop_free_reads()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close_all(store for _, store in self.pieces)


def pieces_of(store) -> list[tuple[int, LayerStore]]:
    """``(first layer, store)`` of the stores of one tier that hold ``store``'s layers: its pieces, or itself.

    Example:
        >>> import jax, jax.numpy as jnp, tempfile
        >>> from zinfjax.store import open_store
        >>> like = {"w": jax.ShapeDtypeStruct((36, 8), jnp.float32)}
        >>> store = open_store("host:12,nvme", like, path=tempfile.mkdtemp())
        >>> [(first, s.tier) for first, s in pieces_of(store)]
        [(0, 'host'), (12, 'nvme')]
        >>> [(first, s.tier) for first, s in pieces_of(store.pieces[0][1])]     # a store of one tier: itself
        [(0, 'host')]
        >>> store.close()
    """
    return list(getattr(store, "pieces", None) or [(0, store)])
