"""One matrix product in XLA and in torch, fp32 and bf16, as gpt2-small's MLP computes it; prints one JSON object.

For ``x @ w`` with x (512, 768) and w (768, 3072) (batch 4 x 128 through GPT-2 small's first MLP
layer) and the two products of its backward, ``g @ w.T`` and ``x.T @ g``, the median time of each in:

- XLA, fp32;
- XLA, bf16 operands and result (what a bf16 model computes);
- XLA, bf16 operands and an fp32 result (``preferred_element_type``), rounded to bf16 after;
- the three products of zinfjax.models.products' VJP (the weight gradient's ``x.T`` first made a
  row-major bf16 array);
- torch, fp32 and bf16.

It shows why autodiff's bf16 backward is no faster than its fp32 one on the CPU backend, and what
zinfjax.models.products changes (docs/BENCHMARKS.md, "bf16 products with their own VJP").

Example:
    $ python bench/matmul.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zinfjax.models import products

REPEATS = 30
FORWARD = (((1,), (0,)), ((), ()))  # x @ w
INPUT_GRAD = (((1,), (1,)), ((), ()))  # g @ w.T
WEIGHT_GRAD = (((0,), (0,)), ((), ()))  # x.T @ g


def median_ms(f, *args) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 2)


def xla(dims, dtype, f32_result: bool):
    def product(a, b):
        if f32_result:
            return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(dtype)
        return lax.dot_general(a, b, dims)
    return jax.jit(product)


def zinfjax_products() -> dict:
    """The three products `products.dense`'s VJP computes, each jitted alone."""
    return {"forward x @ w": jax.jit(lambda x, w: products.dense(x, w)),
            "input grad g @ w.T": jax.jit(lambda g, w: products._product(g, w, products.ROWS_BY_ROWS, g.dtype)),
            "weight grad x.T @ g": jax.jit(lambda x, g: products._product(
                products._row_major_transpose(x), g, products.ROWS_BY_COLUMNS, x.dtype))}


def torch_ms(a, b) -> float:
    a @ b
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 2)


def main() -> int:
    rng = np.random.default_rng(0)
    x, w, g = (rng.standard_normal(s, np.float32) for s in ((512, 768), (768, 3072), (512, 3072)))
    operands = {"forward x @ w": (FORWARD, x, w), "input grad g @ w.T": (INPUT_GRAD, g, w),
                "weight grad x.T @ g": (WEIGHT_GRAD, x, g)}
    out = {"jax": jax.__version__, "shape": "512 x 768 x 3072", "statistic": f"median of {REPEATS}, ms", "xla": {}}
    for name, (dims, a, b) in operands.items():
        a32, b32 = jnp.asarray(a), jnp.asarray(b)
        a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
        out["xla"][name] = {"fp32": median_ms(xla(dims, jnp.float32, False), a32, b32),
                            "bf16": median_ms(xla(dims, jnp.bfloat16, False), a16, b16),
                            "bf16, fp32 result": median_ms(xla(dims, jnp.bfloat16, True), a16, b16),
                            "bf16, zinfjax.models.products": median_ms(zinfjax_products()[name], a16, b16)}
    try:
        import torch
    except ImportError:
        out["torch"] = "not installed"
    else:
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        out["torch"] = {"forward x @ w": {"fp32": torch_ms(tx, tw), "bf16": torch_ms(tx.bfloat16(), tw.bfloat16())},
                        "version": torch.__version__}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
