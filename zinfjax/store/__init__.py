"""Tiered storage of stacked layers: device memory, pinned host memory, or NVMe.

Example:
    >>> from zinfjax.store import open_store, BufferPool
    >>> store = open_store("nvme", like, path="/mnt/nvme/run1", pool=BufferPool(1 << 30))  # doctest: +SKIP
    >>> layer = store.read(3).result()                                                      # doctest: +SKIP

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
