"""The per-device model-state table of docs/sharding.md: a named model under ZeRO stages 0-3, nothing allocated.

The bytes come from `zinfjax.planning.zero_memory` (the engine's own sharding rules); this module adds
the model and the table.

Example:
    $ python -m zinfjax.benchmarks.state_table --model gpt2-small --devices 8
"""

from __future__ import annotations

import argparse
import math

import jax
import optax

from zinfjax import models
from zinfjax.models.stacked import lm_init
from zinfjax.planning.zero_memory import PRECISIONS, state_bytes, zero_formula
from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules


def abstract_params(model_name: str):
    """The abstract parameters of a named model (``jax.eval_shape``, nothing allocated)."""
    return jax.eval_shape(lm_init(models.build(model_name)), jax.random.key(0))


def memory_table(model_name: str = "gpt2-small", devices: int = 8, threshold: int = PERSISTENCE_THRESHOLD,
                 precision: str = "fp32") -> str:
    """A markdown table of per-device model-state bytes for stages 0-3 (Adam), against ZeRO's formula.

    Example:
        >>> print(memory_table("gpt2-small", 8, precision="bf16"))
        gpt2-small: Ψ = 124,439,808 parameters, 8 devices on `data`, bf16 Adam (p=2, g=4, K=12), threshold 1024 elements
        <BLANKLINE>
        | stage | params MiB | grads MiB | optimizer MiB | total MiB | formula MiB | total / formula |
        |---|---|---|---|---|---|---|
        | 0 | 237.4 | 474.7 | 1424.1 | 2136.2 | 2136.2 | 1.0000 |
        | 1 | 237.4 | 474.7 | 178.9 | 890.9 | 890.1 | 1.0010 |
        | 2 | 237.4 | 59.6 | 178.9 | 475.8 | 474.7 | 1.0024 |
        | 3 | 29.8 | 59.6 | 178.9 | 268.3 | 267.0 | 1.0048 |
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
