"""Tiered storage of stacked layers: device memory, pinned host memory, or NVMe.

Example:
    >>> import jax, jax.numpy as jnp, tempfile
    >>> from zinfjax.store import open_store, BufferPool
    >>> like = {"w": jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)}          # 4 layers of (64, 64)
    >>> store = open_store("nvme", like, path=tempfile.mkdtemp(), pool=BufferPool(1 << 20))
    >>> store.write(3, {"w": jnp.full((64, 64), 3.0)}).result()
    >>> layer = store.read(3).result()
    >>> float(layer["w"][0, 0]), store.stats.bytes_read
    (3.0, 16384)
    >>> store.close()

Reading ahead of compute is the engine's (`zinfjax.engine.readahead.ReadAhead`): a store's reads
are futures, and the engine keeps the next ones in flight.
"""

from zinfjax.store.base import LayerStore, StoreStats
from zinfjax.store.errors import (
    BufferBudgetError,
    LayerNotWrittenError,
    LiveStateCorruptError,
    ManifestMismatchError,
    StoreCorruptionError,
    StoreError,
    StoreIOError,
    StoreLockedError,
    StorePathError,
    StoreSpaceError,
    StoreUsageError,
)
from zinfjax.store.factory import TIERS, open_store, staging_bytes
from zinfjax.store.layout import layer_sharding, stacked_sharding
from zinfjax.store.pool import BufferPool, HostBuffer

__all__ = [
    "TIERS",
    "BufferBudgetError",
    "BufferPool",
    "HostBuffer",
    "LayerNotWrittenError",
    "LiveStateCorruptError",
    "LayerStore",
    "ManifestMismatchError",
    "StoreCorruptionError",
    "StoreError",
    "StoreLockedError",
    "StorePathError",
    "StoreUsageError",
    "StoreIOError",
    "StoreSpaceError",
    "StoreStats",
    "layer_sharding",
    "open_store",
    "stacked_sharding",
    "staging_bytes",
]
