"""Meshes, and the sharding rules of the ZeRO stages and of tensor parallelism.

Every piece of model state has a *kind*: ``params`` (the compute copy), ``grads``,
``opt`` (the optax state) and ``master`` (fp32 master weights under mixed precision).
A stage decides which kinds are sharded over the mesh axis ``data``; every stage computes the same step
(docs/design.md, invariant 1):

=====  ===========================================================
stage  sharded over ``data``
=====  ===========================================================
0      nothing
1      ``opt``, ``master``
2      ``opt``, ``master``, ``grads`` (the backward reduce-scatters)
3      everything, ``params`` too (all-gathered inside each layer function)
=====  ===========================================================

Independently, a ``model`` axis shards every kind of a leaf the same way, by the model's
tensor-parallel rules (`Layers.partition_rules`): Megatron's column-parallel input
projections and row-parallel output projections.

Specs here are *per layer*: the layer axis of a stacked leaf is never sharded, because the
engine streams one layer at a time; the stores prepend ``None`` for it.

A leaf stays replicated over ``data`` when it has fewer than ``threshold`` elements (as
DeepSpeed's ``param_persistence_threshold`` keeps small parameters whole), or when none of
its dimensions free of the ``model`` axis divides by the ``data`` size.

Example (8 devices; on a CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
    >>> from zinfjax.models import gpt
    >>> mesh = make_mesh({"data": 4, "model": 2})
    >>> rules = ShardingRules.for_mesh(mesh, stage=3, tp=gpt.PARTITION_RULES)
    >>> rules.spec("params", "blocks/fc/kernel", (64, 256))
    P('data', 'model')
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax.errors import ConfigError

KINDS = ("params", "grads", "opt", "master")
# The lowest stage at which each kind is sharded over ``data``.
FIRST_SHARDED_STAGE = {"opt": 1, "master": 1, "grads": 2, "params": 3}
# Elements below which a leaf stays replicated over ``data``. DeepSpeed's default
# param_persistence_threshold is 1e5; ours is lower so that small models shard too. Gathering
# a small leaf costs a collective's latency, and here it is fused into the layer function.
PERSISTENCE_THRESHOLD = 1024

TpRules = tuple[tuple[str, tuple], ...]  # (path pattern, per-layer spec with "model" or None per dim)


def make_mesh(axes: dict[str, int], devices: list | None = None) -> Mesh:
    """A ``("data", "model")`` mesh; an axis of -1 takes every remaining device.

    Example:
        >>> dict(make_mesh({"data": 4, "model": 2}).shape), dict(make_mesh({"data": -1}).shape)   # of 8 devices
        ({'data': 4, 'model': 2}, {'data': 8, 'model': 1})
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = {"data": axes.get("data", 1), "model": axes.get("model", 1)}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    for name, size in sizes.items():
        if size == -1:
            if len(devices) % fixed:
                raise ConfigError(f"mesh {axes}: {len(devices)} devices do not divide by {fixed}")
            sizes[name] = len(devices) // fixed
    total = sizes["data"] * sizes["model"]
    if total > len(devices):
        raise ConfigError(f"mesh {axes} needs {total} devices but {len(devices)} are available")
    grid = np.array(devices[:total]).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, ("data", "model"))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split over the ``data`` axis on their first dimension."""
    return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())


def check_batch(batch_size: int, mesh: Mesh, grad_accum: int = 1) -> None:
    """Refuses a batch that does not split evenly over micro-batches and the data axis."""
    data = mesh.shape["data"]
    if batch_size % grad_accum or (batch_size // grad_accum) % data:
        raise ConfigError(
            f"batch_size={batch_size} must divide into grad_accum={grad_accum} micro-batches "
            f"whose size divides by the {data} devices of the data axis"
        )


def path_str(path) -> str:
    """A key path as ``a/b/c``: how every layer names a leaf (the program, its optimizer state, checkpoints), and
    the form sharding and tensor-parallel rules match.

    Example:
        >>> path_str(jax.tree_util.tree_flatten_with_path({"q": {"kernel": 0}})[0][0][0])
        'q/kernel'
    """
    return jax.tree_util.keystr(path, simple=True, separator="/")


def tp_spec(tp: TpRules, path: str, ndim: int) -> tuple:
    """The model-axis spec of a leaf: the first rule whose pattern ends ``path`` (at a ``/``), else replicated.

    Optimizer state leaves (``0/mu/q/kernel``) match the rule of their parameter (``q/kernel``).
    A rule written for another rank is ignored, so state of another shape stays replicated.

    Example:
        >>> tp_spec(((r"fc/kernel", (None, "model")),), "blocks/fc/kernel", 2)
        (None, 'model')
    """
    for pattern, spec in tp:
        if re.search(rf"(^|/)(?:{pattern})$", path) and len(spec) == ndim:
            return tuple(spec)
    return (None,) * ndim


def data_dim(shape: Sequence[int], taken: Sequence, data: int, threshold: int) -> int | None:
    """The dimension to shard over ``data``: the largest one divisible by ``data`` not in ``taken``.

    None when ``data`` is 1, the leaf has fewer than ``threshold`` elements, or no free dimension divides.

    Example:
        >>> data_dim((64, 8, 8), (None, "model", None), 4, 1024)
        0
    """
    if data <= 1 or math.prod(shape) < threshold:
        return None
    free = [d for d, n in enumerate(shape) if taken[d] is None and n % data == 0]
    return max(free, key=lambda d: (shape[d], -d)) if free else None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The sharding of every kind of state, for one stage on one mesh shape; hashable.

    Attributes:
        stage: the ZeRO stage, 0-3.
        data: the size of the ``data`` mesh axis.
        model: the size of the ``model`` mesh axis.
        tp: the model's tensor-parallel rules (`Layers.partition_rules`).
        threshold: leaves with fewer elements stay replicated over ``data``.

    Example:
        >>> ShardingRules(stage=2, data=8).spec("grads", "blocks/fc/kernel", (64, 256))
        P(None, 'data')
    """

    stage: int = 0
    data: int = 1
    model: int = 1
    tp: TpRules = ()
    threshold: int = PERSISTENCE_THRESHOLD

    @classmethod
    def for_mesh(cls, mesh: Mesh, stage: int, tp: TpRules = (), threshold: int = PERSISTENCE_THRESHOLD):
        """Rules for ``mesh``'s axis sizes."""
        return cls(stage, mesh.shape["data"], mesh.shape.get("model", 1), tuple(tp), threshold)

    def sharded_over_data(self, kind: str) -> bool:
        """Whether this stage shards ``kind`` over ``data``."""
        if kind not in FIRST_SHARDED_STAGE:
            raise ValueError(f"unknown kind {kind!r}; use one of {KINDS}")
        return self.stage >= FIRST_SHARDED_STAGE[kind]

    def spec(self, kind: str, path: str, shape: Sequence[int]) -> P:
        """The per-layer PartitionSpec of one leaf of ``kind`` at ``path`` (``group/...``) with ``shape``."""
        shape = tuple(shape)
        spec = list(tp_spec(self.tp, path, len(shape)) if self.model > 1 else (None,) * len(shape))
        for d, axis in enumerate(spec):
            if axis is not None and shape[d] % self.model:
                raise ConfigError(
                    f"leaf {path} of shape {shape}: dimension {d} ({shape[d]}) does not divide by the "
                    f"{self.model} devices of the model axis; choose a model axis size that divides it"
                )
        if self.sharded_over_data(kind):
            d = data_dim(shape, spec, self.data, self.threshold)
            if d is not None:
                spec[d] = "data"
        return P(*spec)

    def specs(self, kind: str, group: str, tree):
        """A tree of per-layer PartitionSpecs for ``tree`` (one layer of ``group``; leaves need ``.shape``)."""
        return jax.tree_util.tree_map_with_path(
            lambda p, x: self.spec(kind, f"{group}/{path_str(p)}", np.shape(x)), tree
        )

    def shardings(self, mesh: Mesh, kind: str, group: str, tree):
        """A tree of per-layer NamedShardings on ``mesh`` for ``tree``."""
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs(kind, group, tree),
                            is_leaf=lambda s: isinstance(s, P))

    def canonical(self, kinds: Sequence[str]) -> ShardingRules:
        """These rules at the lowest stage that shards the same ``kinds``; functions of equal rules share compiles.

        Example:
            >>> ShardingRules(stage=1, data=8).canonical(["params", "grads"]).stage
            0
        """
        if self.data == 1:  # nothing to shard: every stage is stage 0
            return dataclasses.replace(self, stage=0)
        same = [s for s in range(4) if all((s >= FIRST_SHARDED_STAGE[k]) == self.sharded_over_data(k) for k in kinds)]
        return dataclasses.replace(self, stage=min(same))

    def compute(self) -> ShardingRules:
        """The rules a layer is computed with: parameters gathered over ``data``, still split over ``model``."""
        return dataclasses.replace(self, stage=0)


def shard_shape(shape: Sequence[int], spec: P, axes: dict[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of an array of ``shape`` split by ``spec`` on a mesh of ``axes``.

    Example:
        >>> shard_shape((64, 256), P("data", "model"), {"data": 4, "model": 2})
        (16, 128)
    """
    out = []
    for d, n in enumerate(shape):
        names = spec[d] if d < len(spec) else None
        names = () if names is None else (names if isinstance(names, tuple) else (names,))
        out.append(n // math.prod(axes[a] for a in names))
    return tuple(out)
