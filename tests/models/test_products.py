"""Low-precision matrix products (zinfjax.models.products): autodiff's results, bf16 kernels, kept as products.

Exactness: a bf16 product accumulates in fp32 and rounds once, so each value of the result, and of
both gradients, is within ``tests.support.tolerances.product_bound`` of the exact product of its operands:
one bf16 rounding of the value, plus fp32's accumulation bound for the contraction's length, in any order.
The plain autodiff product is held to the same bound. A whole model's gradients compound many such
roundings, so they are held to the plain product's: no farther from the fp32 gradients than autodiff's.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from tests.support.tolerances import assert_no_farther, assert_rounds_once
from zinfjax import models
from zinfjax.models import products, vocab
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.program.residuals import Pullback, apply_saved, save_vjp

BF16 = jnp.bfloat16
pytestmark = [pytest.mark.low_precision, pytest.mark.numeric]


def _normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(BF16)


def _plain(x, w, w_rows):
    """The product as autodiff takes it: ``lax.dot_general`` of the bf16 operands."""
    return lax.dot_general(x, w, (((1,), (1 if w_rows else 0,)), ((), ())))


@pytest.mark.parametrize("w_rows", [False, True])
@pytest.mark.parametrize("product", [products.dense, _plain], ids=["dense", "plain"])
def test_the_product_and_both_gradients_round_the_exact_ones_once(product, w_rows):
    x, g = _normal(0, (64, 48)), _normal(1, (64, 96))
    w = _normal(2, (96, 48) if w_rows else (48, 96))
    y, vjp = jax.vjp(lambda x, w: product(x, w, w_rows), x, w)
    dx, dw = vjp(g)
    w_in = w.T if w_rows else w
    assert y.dtype == dx.dtype == dw.dtype == BF16
    assert_rounds_once(y, x, w_in)
    assert_rounds_once(dx, g, w_in.T)
    assert_rounds_once(dw, *((g.T, x) if w_rows else (x.T, g)))


def test_the_bound_catches_a_product_summed_in_bf16():
    """A product whose partial sums are rounded to bf16 (a kernel without fp32 accumulation) lies outside it."""
    x, w = _normal(0, (64, 256)), _normal(1, (256, 32))
    partial = jnp.zeros((64, 32), BF16)
    for k in range(0, 256, 16):  # 16-term blocks accumulated in fp32, each block's sum added in bf16
        partial = (partial.astype(jnp.float32) + x[:, k:k + 16].astype(jnp.float32) @ w[k:k + 16].astype(
            jnp.float32)).astype(BF16)
    assert_rounds_once(_plain(x, w, False), x, w)
    with pytest.raises(AssertionError, match="beyond the bound"):
        assert_rounds_once(partial, x, w)


def test_fp32_operands_and_other_contractions_take_lax_dot_general_bitwise():
    x, w = jax.random.normal(jax.random.key(0), (8, 4)), jax.random.normal(jax.random.key(1), (4, 6))
    np.testing.assert_array_equal(products.dense(x, w), lax.dot_general(x, w, (((1,), (0,)), ((), ()))))
    a, b = _normal(2, (3, 8, 4)), _normal(3, (3, 4, 5))  # a batched product: not a dense layer's
    dims = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(products.dot_general(a, b, dims), lax.dot_general(a, b, dims))


def test_dot_general_takes_a_dense_layers_multi_axis_contraction():
    x, w = _normal(0, (2, 5, 3, 4)), _normal(1, (3, 4, 6))  # attention's output projection: (heads, dim) -> d
    dims = (((2, 3), (0, 1)), ((), ()))
    got = products.dot_general(x, w, dims)
    assert got.shape == (2, 5, 6)
    assert_rounds_once(got.reshape(10, 6), x.reshape(10, 12), w.reshape(12, 6))


def _dot_operand_dtypes(hlo: str) -> list[tuple[str, ...]]:
    """The operand dtypes of every ``dot`` in compiled HLO text (instruction names are unique in a module)."""
    dtype_of = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r"= \w+\[[^\]]*\]\{[^}]*\} dot\(([^)]*)\)", hlo)
    return [tuple(dtype_of[name.strip().lstrip("%")] for name in operands.split(",")) for operands in dots]


def _gradient_hlo(product) -> str:
    x, w = _normal(0, (512, 768)), _normal(1, (768, 384))
    grads = jax.jit(jax.grad(lambda x, w: product(x, w, False).astype(jnp.float32).sum(), argnums=(0, 1)))
    return grads.lower(x, w).compile().as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's rewrite is what the module undoes")
def test_on_the_cpu_backend_every_product_of_the_backward_takes_bf16_operands():
    dots = _dot_operand_dtypes(_gradient_hlo(products.dense))
    assert len(dots) >= 2 and all(set(d) == {"bf16"} for d in dots), dots
    # What the module is for: autodiff's own weight gradient converts its operands to fp32 first.
    plain = _dot_operand_dtypes(_gradient_hlo(_plain))
    assert any("f32" in d for d in plain), plain


def test_the_saved_backward_keeps_the_products_and_does_not_rerun_them():
    w1, w2 = _normal(0, (16, 32)), _normal(1, (32, 16))

    def layer(w1, w2, x):
        return products.dense(jax.nn.gelu(products.dense(x, w1)), w2)

    x, g = _normal(2, (8, 16)), _normal(3, (8, 16))
    pullback = Pullback()
    _, kept = save_vjp(layer, (w1, w2, x), [w1, w2], pullback)
    # Kept: the input, and the first product's output, which gelu's gradient needs (no gradient needs the
    # second's); not the parameters.
    assert sorted(k.shape for k in kept) == [(8, 16), (8, 32)]
    backward = jax.make_jaxpr(lambda kept, g: apply_saved(pullback, kept, [w1, w2], g))(kept, g)
    assert str(backward).count("dot_general") == 4  # two gradients of each product; no forward product again


def _lm_grads(arch: str, dtype=BF16):
    """The gradients of a tiny model's loss at bf16 parameters, taken in ``dtype`` (fp32: the exact ones)."""
    model = models.build(f"{arch}-tiny", dtype)
    init = lm_init(models.build(f"{arch}-tiny"))(jax.random.key(0))
    params = jax.tree.map(lambda p: p.astype(BF16).astype(dtype), init)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, model.config.vocab_size)
    return jax.jit(jax.grad(lm_loss(model)))(params, tokens)


@pytest.mark.parametrize("arch", [pytest.param("gpt2", marks=pytest.mark.wide), "llama"])
def test_the_models_gradients_are_as_close_to_fp32_as_the_plain_products(arch, monkeypatch):
    exact, ours = _lm_grads(arch, jnp.float32), _lm_grads(arch)
    monkeypatch.setattr(products, "dot_general", lax.dot_general)
    monkeypatch.setattr(vocab, "dense", lambda h, w, w_rows: jnp.einsum("...d,vd->...v", h, w))
    plain = _lm_grads(arch)
    # The same sums in another order, each rounded once to bf16: compounded through the model, no a-priori
    # bound; so relative to autodiff's product (tests.support.tolerances).
    reference, got = assert_no_farther(exact, plain, ours)
    print(f"{arch}: from the fp32 gradients, plain {reference:.2e}, ours {got:.2e}")
