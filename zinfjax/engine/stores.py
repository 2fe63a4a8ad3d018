"""The stores a wrapped state lives in, one per (kind, group), each on the tier the config gives.

Kinds: ``params`` (compute copy), ``master`` (fp32 master weights, only under mixed
precision), ``opt`` (optax state), ``grads`` (spooled gradients, only when the step needs
every gradient before updating) and ``acts`` (layer-boundary activation checkpoints).
Groups: ``embed`` and ``head`` are stores of one layer, ``blocks`` of L layers.

Every leaf carries the sharding its kind has at the config's stage (zinfjax/sharding.py), so
a tier holds, reads and writes each device's own shard of each layer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax.config import Config
from zinfjax.sharding import ShardingRules
from zinfjax.store import BufferPool, LayerStore, open_store, staging_bytes
from zinfjax.store.disk import check_free_space, prepare_directory
from zinfjax.store.errors import BufferBudgetError

GROUPS = ("embed", "blocks", "head")
# The engine's nvme stores hold its working state, which a crash mid-step leaves inconsistent
# across layers whatever each chunk does; durable copies are checkpoints. So chunks are
# overwritten in place, without fsync: no inode made and freed per chunk, no flush to wait for.
# The checksum still catches a chunk torn by a crash.
SCRATCH_NVME = {"atomic": False, "file_io_sync": False}


def stacked_like(tree, group: str, shardings):
    """Abstract stacked leaves with a tree of stacked ``shardings``: ``embed`` and ``head`` gain a layer axis of 1."""

    def one(x, sharding):
        shape = x.shape if group == "blocks" else (1, *x.shape)
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree, shardings)


def opt_like(tx, abstract):
    """The abstract optax state of each group of fp32 ``abstract`` params; ``blocks`` state is stacked per layer.

    Example:
        >>> opt_like(optax.adamw(1e-3), abstract)["blocks"][0].mu["fc"]["kernel"].shape
        (4, 64, 256)
    """
    def f32(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree)

    return {g: jax.eval_shape(jax.vmap(tx.init) if g == "blocks" else tx.init, f32(abstract[g])) for g in GROUPS}


def layer_like(tree, group: str):
    """One layer of an abstract group: ``blocks`` leaves lose their layer axis."""
    if group != "blocks":
        return tree
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)


def stacked_shardings(rules: ShardingRules, mesh: Mesh, kind: str, group: str, tree):
    """The stacked sharding of each leaf of ``tree`` (a whole group): its layer spec after an unsharded layer axis.

    Example:
        >>> stacked_shardings(ShardingRules(stage=3, data=8), mesh, "params", "blocks", abstract["blocks"])
    """
    specs = rules.specs(kind, group, layer_like(tree, group))
    return jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s)), specs, is_leaf=lambda s: isinstance(s, P))


def unstack(tree, group: str):
    """Layer views of a concrete tree: ``embed``/``head`` gain their layer axis of 1."""
    return tree if group == "blocks" else jax.tree.map(lambda x: x[None], tree)


@dataclasses.dataclass
class EngineStores:
    """Every store of one wrapped state."""

    params: dict[str, LayerStore]
    opt: dict[str, LayerStore]
    master: dict[str, LayerStore] | None
    grads: dict[str, LayerStore] | None
    acts: LayerStore
    pool: BufferPool

    def all(self) -> list[LayerStore]:
        kinds = [self.params, self.opt, self.master or {}, self.grads or {}]
        return [s for kind in kinds for s in kind.values()] + [self.acts]

    def flush(self) -> None:
        for store in self.all():
            store.flush()

    def close(self) -> None:
        for store in self.all():
            store.close()


def plan_stores(config: Config, mesh: Mesh, rules: ShardingRules, params_like, opt_like, act_like, spool: bool,
                compute_dtype) -> list[tuple[str, str, str, object]]:
    """Every store as ``(kind, group, tier, stacked abstract tree)``, before anything is opened.

    Each leaf carries its kind's sharding under ``rules``; a tensor-parallel split that does
    not divide is refused here, before any store is opened.
    """
    mixed = compute_dtype != jnp.float32

    def cast(tree, dtype):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype), tree)

    kinds = [("params", config.params, params_like, compute_dtype), ("opt", config.optimizer, opt_like, None)]
    if mixed:
        kinds.append(("master", config.optimizer, params_like, jnp.float32))
    if spool:
        kinds.append(("grads", config.gradients, params_like, jnp.float32))
    plan = [(kind, g, tier, stacked_like(cast(like[g], dtype), g, stacked_shardings(rules, mesh, kind, g, like[g])))
            for kind, tier, like, dtype in kinds for g in GROUPS]
    return [*plan, ("acts", "blocks", config.activations, act_like)]


def build_stores(config: Config, plan) -> EngineStores:
    """Checks the plan against the disk and the buffer budget, then opens every store (empty)."""
    preflight(config, plan)
    pool = BufferPool(config.host_buffer_bytes)
    opened: dict[str, dict[str, LayerStore]] = {}
    for kind, group, tier, like in plan:
        name = kind if kind == "acts" else f"{kind}_{group}"
        options = SCRATCH_NVME if tier == "nvme" else {}
        opened.setdefault(kind, {})[group] = open_store(tier, like, path=config.nvme_path, name=name, pool=pool,
                                                        **options)
    return EngineStores(
        params=opened["params"], opt=opened["opt"], master=opened.get("master"), grads=opened.get("grads"),
        acts=opened["acts"]["blocks"], pool=pool,
    )


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def preflight(config: Config, plan) -> None:
    """Before anything is written: the path is writable, can hold the state, and one layer fits the buffers."""
    on_nvme = [like for _, _, tier, like in plan if tier == "nvme"]
    if not on_nvme:
        return
    layer = max(staging_bytes(like) for like in on_nvme)
    if layer > config.host_buffer_bytes:
        raise BufferBudgetError(
            f"host_buffer_bytes={config.host_buffer_bytes} cannot hold one layer: the largest layer needs "
            f"{layer} bytes; raise host_buffer_bytes to at least {layer}"
        )
    prepare_directory(config.nvme_path)
    check_free_space(config.nvme_path, sum(_nbytes(like) for like in on_nvme))
