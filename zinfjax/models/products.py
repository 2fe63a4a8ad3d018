"""Matrix products of low-precision operands (bf16, fp16) at the speed of their own kernels, on every backend.

XLA computes ``x @ w`` of bf16 operands with fp32 accumulation and rounds the result to bf16. On
the CPU backend it does so with a bf16 kernel only where the product's operands are row-major with
the contracted axis last on the left: a forward ``x @ w`` and an input gradient ``g @ w.T`` qualify,
but the weight gradient ``x.T @ g`` that autodiff writes contracts the token axis of both operands,
so XLA converts them to fp32 and takes the fp32 kernel, twice as slow (bench/matmul.py).

`dense` is that product with a VJP of its own: on the CPU backend the weight gradient transposes ``x``
in bf16 into a row-major array first (a layout constraint), so all three products run the bf16 kernel. Its
results are those of autodiff's (bf16 operands, fp32 accumulation, one rounding to the operand
dtype), up to the order of the sums; ``tests/models/test_products.py`` holds it to them. fp32 operands,
and any contraction other than a dense layer's, take ``jax.lax.dot_general`` unchanged.

`dot_general` has ``lax.dot_general``'s signature, for flax's ``nn.DenseGeneral(dot_general=...)``.

Example:
    >>> x, w = jnp.ones((4, 3), jnp.bfloat16), jnp.ones((3, 2), jnp.bfloat16)
    >>> dense(x, w).dtype, dense(x, w).shape
    (dtype(bfloat16), (4, 2))
    >>> float(jax.grad(lambda w: dense(x, w).astype(jnp.float32).sum())(w)[0, 0])
    4.0
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ROWS_BY_COLUMNS = (((1,), (0,)), ((), ()))  # a @ b, both 2-D
ROWS_BY_ROWS = (((1,), (1,)), ((), ()))  # a @ b.T


def accumulator(dtype) -> jnp.dtype:
    """The dtype sums of ``dtype`` values are taken in: fp32, or ``dtype`` itself where it is wider (float64, in the
    tests' runs that stand for the exact computation).

    Example:
        >>> accumulator(jnp.bfloat16), accumulator(jnp.float32)
        (dtype('float32'), dtype('float32'))
    """
    return jnp.promote_types(dtype, jnp.float32)


def _product(a: jax.Array, b: jax.Array, dims, dtype) -> jax.Array:
    """``dot_general`` accumulated in fp32 (or wider operands' own dtype) and rounded once to ``dtype``."""
    return lax.dot_general(a, b, dims, preferred_element_type=accumulator(a.dtype)).astype(dtype)


def _row_major_transpose(a: jax.Array) -> jax.Array:
    """``a.T`` stored row-major on the CPU backend, so a product that takes it sees a plain left operand;
    elsewhere ``a.T`` (GPU and TPU products take transposed operands as they are)."""
    if jax.default_backend() != "cpu":
        return a.T
    return with_layout_constraint(a.T, Layout(major_to_minor=(0, 1)))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, w_rows: bool) -> jax.Array:
    """``x @ w`` of 2-D operands, or ``x @ w.T`` when ``w_rows`` (``w`` holds one output per row)."""
    return _product(x, w, ROWS_BY_ROWS if w_rows else ROWS_BY_COLUMNS, x.dtype)


def _matmul_fwd(x, w, w_rows):
    return _matmul(x, w, w_rows), (x, w)


def _matmul_bwd(w_rows, residuals, g):
    x, w = residuals
    dx = _product(g, w, ROWS_BY_COLUMNS if w_rows else ROWS_BY_ROWS, x.dtype)
    if w_rows:  # dw = g.T @ x
        return dx, _product(_row_major_transpose(g), x, ROWS_BY_COLUMNS, w.dtype)
    return dx, _product(_row_major_transpose(x), g, ROWS_BY_COLUMNS, w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense(x: jax.Array, w: jax.Array, w_rows: bool = False) -> jax.Array:
    """``x @ w`` (``x @ w.T`` when ``w_rows``) over the last axis of ``x`` and the first (last) of ``w``.

    Low-precision operands of one dtype take the VJP above; others, ``lax.dot_general``.

    Example:
        >>> dense(jnp.ones((2, 5, 3)), jnp.ones((4, 3)), w_rows=True).shape
        (2, 5, 4)
    """
    if not (x.dtype == w.dtype and x.dtype in LOW_PRECISION and w.ndim == 2):
        return lax.dot_general(x, w, (((x.ndim - 1,), (1 if w_rows else 0,)), ((), ())))
    out = _matmul(x.reshape(-1, x.shape[-1]), w, w_rows)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None) -> jax.Array:
    """``lax.dot_general``, with a dense layer's contraction (trailing axes of ``lhs`` with leading axes of
    ``rhs``, no batch axes) of low-precision operands taken by `dense`.

    Example:
        >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 2, 2), jnp.bfloat16)
        >>> dot_general(x, w, (((1,), (0,)), ((), ()))).shape
        (2, 2, 2)
    """
    (lc, rc), batch = dimension_numbers
    n = len(lc)
    plain = (
        any(batch) or precision is not None or preferred_element_type is not None
        or tuple(lc) != tuple(range(lhs.ndim - n, lhs.ndim)) or tuple(rc) != tuple(range(n))
        or not (lhs.dtype == rhs.dtype and lhs.dtype in LOW_PRECISION)
    )
    if plain:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type)
    x = lhs.reshape(*lhs.shape[: lhs.ndim - n], -1)
    return dense(x, rhs.reshape(x.shape[-1], -1)).reshape(*x.shape[:-1], *rhs.shape[n:])
