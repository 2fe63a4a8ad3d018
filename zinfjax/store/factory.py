"""`open_store`: one entry point for the three tiers."""

from __future__ import annotations

import os

import jax

from zinfjax._util.choices import TIERS
from zinfjax._util.tier_split import SplitError, TierSplit
from zinfjax.store.base import LayerStore
from zinfjax.store.chunkfile import slot_bytes
from zinfjax.store.errors import StoreUsageError
from zinfjax.store.layout import leaf_layout, leaf_names
from zinfjax.store.memory import DeviceStore, HostStore
from zinfjax.store.nvme import NvmeStore
from zinfjax.store.pool import BufferPool
from zinfjax.store.split import SplitStore


def open_store(
    tier: str,
    like,
    *,
    path: str | None = None,
    name: str = "params",
    pool: BufferPool | None = None,
    mesh_sharding=None,
    create: bool = True,
    host_kind: str | None = None,
    **nvme_options,
) -> LayerStore:
    """Opens (or creates) a store of stacked leaves on one tier.

    Args:
        tier: "device", "host" or "nvme", or a split of host and nvme layers such as "host:12,nvme"
            (`zinfjax.store.split`): each run of layers in a store of its tier, the nvme one under ``path/name``.
        like: a tree of `jax.ShapeDtypeStruct` (or arrays) with leaves `(L, ...)`. A leaf's
            `.sharding`, a NamedSharding with None on axis 0, sets its layout; without one the leaf
            lives on the first local device.
        path: for nvme, the directory (`nvme_path`) the store lives under, as `path/name/`.
        name: the store's name, its directory under `path`.
        pool: the host buffer pool the nvme tier stages through.
        mesh_sharding: a stacked sharding, or a tree of them matching `like`, for leaves that
            carry no sharding of their own.
        create: for nvme, create the store when none exists at `path/name`.
        host_kind: for host, the memory kind it keeps its layers in (default: `host_tier_kind`).
        **nvme_options: passed to `NvmeStore` (read_threads, write_threads, file_io_* options).

    Returns:
        A `LayerStore`.

    Example:
        >>> import jax.numpy as jnp, tempfile
        >>> like = {"w": jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)}       # 4 layers of (8, 8)
        >>> store = open_store("nvme", like, path=tempfile.mkdtemp())
        >>> store.write(0, {"w": jnp.ones((8, 8))}).result()
        >>> layer = store.read(0).result()["w"]
        >>> layer.shape, float(layer.sum())
        ((8, 8), 64.0)
        >>> store.close()
    """
    layouts = _layouts(like, mesh_sharding)
    if len({lay.num_layers for lay in layouts}) > 1:
        raise StoreUsageError(
            f"all leaves need the same number of layers, got {sorted({lay.num_layers for lay in layouts})}"
        )
    try:
        split = TierSplit.parse(tier)
    except SplitError as e:
        raise StoreUsageError(f"unknown tier {tier!r}; use one of {', '.join(TIERS)} or a split (host:12,nvme)") from e
    if not split.whole:
        length = layouts[0].num_layers if layouts else 0
        args = dict(path=path, name=name, pool=pool, mesh_sharding=mesh_sharding, create=create, host_kind=host_kind)
        pieces = [(a, open_store(t, _layers(like, a, b), **args, **nvme_options)) for t, a, b in split.ranges(length)]
        return SplitStore(like, layouts, pieces, str(split))
    return _open_tier(tier, like, layouts, path, name, pool, create, host_kind, nvme_options)


def _open_tier(tier, like, layouts, path, name, pool, create, host_kind, nvme_options) -> LayerStore:
    if tier == "device":
        return DeviceStore(like, layouts)
    if tier == "host":
        return HostStore(like, layouts, host_kind)
    if tier == "nvme":
        if path is None:
            raise StoreUsageError("the nvme tier needs a path; set nvme_path=/path/on/fast/disk")
        return NvmeStore(like, layouts, os.path.join(path, name), pool, create=create, **nvme_options)
    raise StoreUsageError(f"unknown tier {tier!r}; use one of {', '.join(TIERS)}")


def _layers(like, start: int, stop: int):
    """``like`` with its leaves' layers ``start:stop``: the abstract tree of one piece of a split store."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((stop - start, *x.shape[1:]), x.dtype,
                                                       sharding=getattr(x, "sharding", None)), like)


def staging_bytes(like, mesh_sharding=None) -> int:
    """Host buffer bytes the nvme tier stages one layer of `like` through (a read or a write).

    This is the least `host_buffer_bytes` that can hold a layer: each chunk's bytes and checksum,
    padded to the direct-I/O block.

    Example:
        >>> import jax.numpy as jnp
        >>> staging_bytes({"w": jax.ShapeDtypeStruct((4, 1000), jnp.float32)})
        4096
    """
    layouts = _layouts(like, mesh_sharding)
    reads = sum(slot_bytes(lay.shard_nbytes) for lay in layouts for s in lay.shards if s.devices)
    writes = sum(slot_bytes(lay.shard_nbytes) for lay in layouts for s in lay.shards if s.writer)
    return max(reads, writes)


def _layouts(like, mesh_sharding):
    leaves, treedef = jax.tree_util.tree_flatten(like)
    if mesh_sharding is None or not isinstance(mesh_sharding, jax.sharding.Sharding):
        fallbacks = (
            treedef.flatten_up_to(mesh_sharding) if mesh_sharding is not None else [None] * len(leaves)
        )
    else:
        fallbacks = [mesh_sharding] * len(leaves)
    names = leaf_names(like)
    return [
        leaf_layout(n, x, getattr(x, "sharding", None) or fb)
        for n, x, fb in zip(names, leaves, fallbacks, strict=True)
    ]
