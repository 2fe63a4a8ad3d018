"""Per-device bytes of the model state under each ZeRO stage, from abstract shapes alone.

Nothing is allocated: the parameters come from ``jax.eval_shape``, and each leaf's shard
shape from the same `ShardingRules` the engine stores it with. The table compares the figures
with ZeRO's formulas; docs/sharding.md holds the one for GPT-2 small on 8 devices.

Example:
    $ python -m zinfjax.engine.memory --model gpt2-small --devices 8
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zinfjax.program.optimizer import owner_of
from zinfjax.program.split import path_str
from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules, shard_shape


def stacked_blocks(path: str) -> bool:
    """The reference models' layout: leaves under ``blocks/`` are stacked on a layer axis."""
    return path.startswith("blocks/")


def _cast(tree, dtype):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), tree)


def leaf_bytes(rules: ShardingRules, kind: str, path: str, x, layers: int) -> int:
    """Bytes one device holds of leaf ``x`` of ``kind`` at ``path``: ``layers`` slices along axis 0, or whole (1).

    Example:
        >>> leaf_bytes(ShardingRules(stage=3, data=8), "params", "blocks/fc/kernel", kernel, layers=12)
    """
    shape = tuple(x.shape[1:]) if layers else tuple(x.shape)
    axes = {"data": rules.data, "model": rules.model}
    spec = rules.spec(kind, path, shape)
    return max(layers, 1) * math.prod(shard_shape(shape, spec, axes)) * np.dtype(x.dtype).itemsize


def state_bytes(abstract, tx: optax.GradientTransformation, rules: ShardingRules, compute_dtype=jnp.float32,
                stacked=stacked_blocks) -> dict[str, int]:
    """Bytes one device holds of each kind of model state: params, grads, opt (and master under mixed precision).

    Leaves whose path ``stacked`` accepts are sharded per layer; gradients are counted in float32,
    as the engine's gradient tier holds them.

    Example:
        >>> state_bytes(abstract, optax.adamw(1e-3), ShardingRules(stage=2, data=8))["grads"]
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


def abstract_params(model_name: str):
    """The abstract parameters of a named model (``jax.eval_shape``, nothing allocated)."""
    from zinfjax import models
    from zinfjax.models.stacked import lm_init

    return jax.eval_shape(lm_init(models.build(model_name)), jax.random.key(0))


PRECISIONS = {  # compute dtype, and ZeRO's bytes per parameter: p params, g grads, K optimizer (+ master)
    "fp32": (jnp.float32, 4, 4, 8),
    "bf16": (jnp.bfloat16, 2, 4, 12),  # gradients stay fp32 in the gradient tier
}


def memory_table(model_name: str = "gpt2-small", devices: int = 8, threshold: int = PERSISTENCE_THRESHOLD,
                 precision: str = "fp32") -> str:
    """A markdown table of per-device model-state bytes for stages 0-3 (Adam), against ZeRO's formula.

    Example:
        >>> print(memory_table("gpt2-small", 8, precision="bf16"))
    """
    abstract = abstract_params(model_name)
    psi = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))
    dtype, p, g, k = PRECISIONS[precision]
    lines = [f"{model_name}: Ψ = {psi:,} parameters, {devices} devices on `data`, {precision} Adam "
             f"(p={p}, g={g}, K={k}), threshold {threshold} elements", "",
             "| stage | params MiB | grads MiB | optimizer MiB | total MiB | formula MiB | total / formula |",
             "|---|---|---|---|---|---|---|"]
    mib = 2.0**20
    for stage in range(4):
        b = state_bytes(abstract, optax.adamw(1e-3), ShardingRules(stage, devices, 1, (), threshold), dtype)
        total, formula = sum(b.values()), zero_formula(stage, psi, devices, p, g, k)
        opt = b["opt"] + b.get("master", 0)
        lines.append(f"| {stage} | {b['params'] / mib:.1f} | {b['grads'] / mib:.1f} | {opt / mib:.1f} | "
                     f"{total / mib:.1f} | {formula / mib:.1f} | {total / formula:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--threshold", type=int, default=PERSISTENCE_THRESHOLD)
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    args = parser.parse_args(argv)
    print(memory_table(args.model, args.devices, args.threshold, args.precision))


if __name__ == "__main__":
    main()
