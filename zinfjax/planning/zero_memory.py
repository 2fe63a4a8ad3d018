"""Per-device bytes of the model state under each ZeRO stage, from abstract shapes alone.

Nothing is allocated: the parameters come from ``jax.eval_shape``, and each leaf's shard
shape from the same `ShardingRules` the engine stores it with. The table compares the figures
with ZeRO's formulas; docs/sharding.md holds the one for GPT-2 small on 8 devices
(`zinfjax.benchmarks.state_table` makes it for a named model).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zinfjax.models.layered import stacked_blocks
from zinfjax.program.optimizer import owner_of
from zinfjax.sharding import ShardingRules, path_str, shard_shape


def _cast(tree, dtype):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), tree)


def leaf_bytes(rules: ShardingRules, kind: str, path: str, x, layers: int) -> int:
    """Bytes one device holds of leaf ``x`` of ``kind`` at ``path``: ``layers`` slices along axis 0, or whole (1).

    Example (12 layers of a (768, 3072) fp32 kernel, split over 8 devices at stage 3):
        >>> kernel = jax.ShapeDtypeStruct((12, 768, 3072), jnp.float32)
        >>> stage3, stage2 = ShardingRules(stage=3, data=8), ShardingRules(stage=2, data=8)
        >>> leaf_bytes(stage3, "params", "blocks/fc/kernel", kernel, layers=12) == 12 * 768 * 3072 * 4 // 8
        True
        >>> leaf_bytes(stage2, "params", "blocks/fc/kernel", kernel, layers=12) >> 20   # whole: 108 MiB
        108
    """
    shape = tuple(x.shape[1:]) if layers else tuple(x.shape)
    axes = {"data": rules.data, "model": rules.model}
    spec = rules.spec(kind, path, shape)
    return max(layers, 1) * math.prod(shard_shape(shape, spec, axes)) * np.dtype(x.dtype).itemsize


def state_bytes(abstract, tx: optax.GradientTransformation, rules: ShardingRules, compute_dtype=jnp.float32,
                stacked=stacked_blocks) -> dict[str, int]:
    """Bytes one device holds of each kind of model state: params, grads, opt (and master under mixed precision).

    Leaves whose path ``stacked`` accepts are sharded per layer; gradients are counted in float32,
    as the engine's gradient tier holds them. Not `zinfjax.planning.scale.state_bytes`, the whole model's
    bytes from its `ModelConfig` alone, which counts gradients in the compute dtype as the ZeRO papers do.

    Example (stage 2 splits gradients and optimizer state over the 8 devices, not the parameters):
        >>> abstract = {"blocks": {"w": jax.ShapeDtypeStruct((4, 64, 256), jnp.float32)}}   # 65,536 parameters
        >>> state_bytes(abstract, optax.adamw(1e-3), ShardingRules(stage=2, data=8))
        {'params': 262144, 'grads': 32768, 'opt': 65540}
    """
    f32 = _cast(abstract, jnp.float32)
    params = [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(f32)[0]]
    layers = {path: x.shape[0] for path, x in params if stacked(path)}
    kinds = {"params": compute_dtype, "grads": jnp.float32}
    if compute_dtype != jnp.float32:
        kinds["master"] = jnp.float32
    out = {kind: sum(leaf_bytes(rules, kind, path, jax.ShapeDtypeStruct(x.shape, dtype), layers.get(path, 0))
                     for path, x in params) for kind, dtype in kinds.items()}
    paths = [path for path, _ in params]
    total = 0
    for p, x in jax.tree_util.tree_flatten_with_path(jax.eval_shape(tx.init, f32))[0]:
        path = path_str(p)
        owner = owner_of(path, paths)
        n = layers[owner] if owner in layers and np.ndim(x) and np.shape(x)[0] == layers[owner] else 0
        total += leaf_bytes(rules, "opt", path, x, n)
    out["opt"] = total
    return out


def zero_formula(stage: int, psi: int, n: int, p: int = 4, g: int = 4, k: int = 8) -> float:
    """ZeRO's per-device model-state bytes, all leaves sharded: ``p`` bytes/param params, ``g`` grads, ``k`` optimizer.

    The paper's mixed-precision Adam is p=2, g=2, k=12; fp32 Adam here is p=4, g=4, k=8.

    Example:
        >>> zero_formula(3, 10**6, 8)
        2000000.0
    """
    sharded = {0: 0, 1: k, 2: g + k, 3: p + g + k}[stage]
    return (p + g + k - sharded) * psi + sharded * psi / n


PRECISIONS = {  # compute dtype, and ZeRO's bytes per parameter: p params, g grads, K optimizer (+ master)
    "fp32": (jnp.float32, 4, 4, 8),
    "bf16": (jnp.bfloat16, 2, 4, 12),  # gradients stay fp32 in the gradient tier
}
