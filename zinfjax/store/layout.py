"""How a stacked leaf splits into layers and device shards.

A stacked leaf has shape `(L, ...)` and a sharding whose PartitionSpec is `None` on axis 0: the
layer axis is never sharded. One layer then has the same sharding without that axis. This module
turns the stacked description into per-layer facts the tiers need: the layer sharding, the shard
shape (which is the nvme chunk), and which shards this process reads and writes.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from zinfjax.store.errors import StoreUsageError

Index = tuple[slice, ...]


def default_sharding() -> Sharding:
    """The sharding of a leaf that carries none: the first local device."""
    return SingleDeviceSharding(jax.local_devices()[0])


def layer_sharding(stacked: Sharding | None) -> Sharding:
    """The sharding of one layer of a stacked leaf whose sharding is `stacked`.

    Example:
        >>> mesh = jax.make_mesh((8,), ("data",))
        >>> layer_sharding(NamedSharding(mesh, PartitionSpec(None, "data"))).spec
        P('data',)
    """
    if stacked is None:
        return default_sharding()
    if isinstance(stacked, SingleDeviceSharding):
        return stacked
    if isinstance(stacked, NamedSharding):
        spec = tuple(stacked.spec)
        if spec and spec[0] is not None:
            raise StoreUsageError(
                f"the layer axis (axis 0) of a stacked leaf must not be sharded, got spec {stacked.spec}; "
                "use PartitionSpec(None, ...)"
            )
        return NamedSharding(stacked.mesh, PartitionSpec(*spec[1:]), memory_kind=stacked.memory_kind)
    raise StoreUsageError(f"the store handles NamedSharding or SingleDeviceSharding, got {type(stacked).__name__}")


def stacked_sharding(layer: Sharding) -> Sharding:
    """The inverse of `layer_sharding`: prepends an unsharded layer axis."""
    if isinstance(layer, NamedSharding):
        return NamedSharding(layer.mesh, PartitionSpec(None, *layer.spec), memory_kind=layer.memory_kind)
    return layer


HOST_KINDS = ("pinned_host", "unpinned_host")  # JAX's host memory kinds, the one DMA can use first


def pick_host_kind(platform: str, kinds) -> tuple[str, str | None]:
    """The memory kind the host tier uses given a platform's memory ``kinds``, and why it is not
    ``pinned_host`` (None when it is).

    Example:
        >>> pick_host_kind("cpu", ["device", "pinned_host", "unpinned_host"])
        ('pinned_host', None)
        >>> pick_host_kind("tpu", ["device", "unpinned_host"])[0]
        'unpinned_host'
    """
    for kind in HOST_KINDS:
        if kind in kinds:
            why = None if kind == "pinned_host" else f"{platform} has no pinned_host memory; the host tier uses {kind}"
            return kind, why
    return "device", (f"{platform} has no host memory kind (it has {', '.join(sorted(kinds))}); the host tier "
                      "keeps its layers in device memory")


def host_memory_kind(device=None) -> tuple[str, str | None]:
    """`pick_host_kind` for ``device`` (default: the first device)."""
    device = device or jax.devices()[0]
    return pick_host_kind(device.platform, [m.kind for m in device.addressable_memories()])


CPU_HOST_TIER = ("on the CPU backend device memory is host memory: the host tier keeps its layers there and "
                 "hands them to compute without a copy")


def host_tier_kind(device=None, update_on_host: bool = False) -> tuple[str, str | None]:
    """The memory kind the host tier keeps its layers in, and why it is not ``pinned_host`` (None when it is).

    On an accelerator: `host_memory_kind`. On the CPU backend the device's memory is host RAM, so a
    layer in ``pinned_host`` is a second copy of the same bytes in the same RAM, copied on every read
    and write; the tier keeps it in ``device`` memory instead. The exception is the optimizer update
    on the host (``update_on=host``), whose operands `compute_on` needs in a host memory kind.

    Example:
        >>> host_tier_kind(jax.devices("cpu")[0])[0]
        'device'
        >>> host_tier_kind(jax.devices("cpu")[0], update_on_host=True)
        ('pinned_host', None)
    """
    device = device or jax.devices()[0]
    if device.platform == "cpu" and not update_on_host:
        return "device", CPU_HOST_TIER
    return host_memory_kind(device)


def with_memory_kind(sharding: Sharding, kind: str) -> Sharding:
    """`sharding` placed in JAX memory kind `kind` (`device` or `pinned_host`)."""
    return sharding.with_memory_kind(kind)


def leaf_names(tree) -> list[str]:
    """Filesystem-safe, unique names for the leaves of `tree`, from their key paths.

    Example:
        >>> leaf_names({"blocks": {"w": 0, "b": 1}})
        ['blocks.b', 'blocks.w']
    """
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = [_safe_name(path) for path, _ in paths]
    if len(set(names)) != len(names):
        raise StoreUsageError(f"leaf names collide after sanitising: {names}")
    return names


def _safe_name(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    name = ".".join(re.sub(r"[^A-Za-z0-9_\-]", "_", p) for p in parts)
    return name or "leaf"


@dataclasses.dataclass(frozen=True)
class Shard:
    """One distinct shard of a layer, as this process sees it.

    Attributes:
        index: the slices of the layer it covers.
        devices: the addressable devices that hold a copy (empty if none here).
        writer: whether this process writes it: it holds a copy. Every process has its own
            store directory (a lock keeps processes apart), so a shard replicated over
            processes is written by each of them into its own directory.
    """

    index: Index
    devices: tuple
    writer: bool


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Everything the tiers need to know about one stacked leaf.

    Attributes:
        name: the leaf's name (its directory under the store).
        num_layers: `L`, the size of axis 0.
        layer_shape: the shape of one layer.
        dtype: the numpy dtype.
        sharding: the per-layer sharding, in device memory.
        shards: the distinct shards, in a fixed order shared by all processes.
    """

    name: str
    num_layers: int
    layer_shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Sharding
    shards: tuple[Shard, ...]

    @functools.cached_property  # asked per read and write
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of one device shard of a layer; one nvme chunk is `(1, *shard_shape)`."""
        return tuple(self.sharding.shard_shape(self.layer_shape))

    @functools.cached_property  # asked per read and write
    def shard_nbytes(self) -> int:
        return int(np.prod(self.shard_shape, dtype=np.int64)) * self.dtype.itemsize

    @functools.cached_property  # asked per read and write
    def layer_nbytes(self) -> int:
        return int(np.prod(self.layer_shape, dtype=np.int64)) * self.dtype.itemsize


def leaf_layout(name: str, like: jax.ShapeDtypeStruct, stacked: Sharding | None) -> LeafLayout:
    """The `LeafLayout` of a stacked leaf `like`, sharded as `stacked` (or the default device)."""
    if len(like.shape) < 1:
        raise StoreUsageError(f"leaf {name!r} has shape {like.shape}; stacked leaves need a layer axis (L, ...)")
    shape = tuple(int(d) for d in like.shape[1:])
    sharding = with_memory_kind(layer_sharding(stacked), "device")
    _check_even(name, shape, sharding)
    return LeafLayout(
        name, int(like.shape[0]), shape, np.dtype(like.dtype), sharding, _shards(sharding, shape)
    )


def _check_even(name: str, shape: tuple[int, ...], sharding: Sharding) -> None:
    shard = sharding.shard_shape(shape)
    for dim, (n, s) in enumerate(zip(shape, shard, strict=True)):
        if s and n % s:
            raise StoreUsageError(
                f"leaf {name!r}: layer axis {dim} of size {n} does not split evenly into shards of {s}"
            )


def _shards(sharding: Sharding, shape: tuple[int, ...]) -> tuple[Shard, ...]:
    me = jax.process_index()
    groups: dict[tuple, list] = {}
    order: list[tuple] = []
    for device, index in sharding.devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) for s in _normalise(index, shape))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(device)
    shards = []
    for key in sorted(order, key=lambda k: tuple(a or 0 for a, _ in k)):
        devices = groups[key]
        local = tuple(d for d in devices if d.process_index == me)
        index = tuple(slice(a, b) for a, b in key)
        shards.append(Shard(index, local, writer=bool(local)))
    return tuple(shards)


def _normalise(index: Index, shape: tuple[int, ...]) -> Index:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def mesh_description(sharding: Sharding) -> dict | None:
    """The mesh axis names and sizes of a NamedSharding, for the manifest; None otherwise."""
    if isinstance(sharding, NamedSharding):
        return {
            "axis_names": list(sharding.mesh.axis_names),
            "shape": [int(s) for s in sharding.mesh.devices.shape],
        }
    return None


def spec_description(sharding: Sharding) -> list | None:
    """The per-layer PartitionSpec as JSON (lists for multi-axis entries); None if unsharded."""
    if not isinstance(sharding, NamedSharding):
        return None
    return [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
