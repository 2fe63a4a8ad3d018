"""Tiled layers (zinfjax.models.tiled, tiled_nnx): the untiled layer's results, gradients and initial distribution.

Tolerances. Tiling changes only how the sums of a product are blocked and ordered: a tiled product is the
untiled one with its contraction cut into blocks that are added in ascending order. A sum of ``n`` products
accumulated in fp32, in any order and blocking, is within ``gamma_n`` of the exact sum relative to the sum of
the terms' magnitudes (Higham, eq. 3.4; ``tests.support.tolerances.gamma``), so the tiled and untiled results,
each within that of the exact result computed in float64, are within twice it of each other:

- ``x @ W + b`` (``n = in + 1`` terms, the bias one of them): ``2 gamma(in + 1) (|x| @ |W| + |b|)``;
- its gradients under ``loss = sum(y * g)``: ``dW = x^T g`` and ``db = sum g`` over the ``rows`` of ``x``, ``dx =
  g @ W^T`` over ``out``: ``2 gamma(rows) |x|^T @ |g|``, ``2 gamma(rows) sum |g|``, ``2 gamma(out) |g| @ |W|^T``;
- the MLP composes two such products through the activation (`mlp_bounds`). ReLU is exact and 1-Lipschitz, so
  its bound is rigorous; its gradients are too where no pre-activation lies within its error of the kink (the
  test checks that of its draw). GELU (tanh form) is 1.13-Lipschitz, and its fp32 evaluation is taken to be
  within ``GELU_ULPS`` units of ``|h| (1 + h^2)`` (the rounding of ``h^3`` and of ``tanh``'s argument, each
  scaled by ``tanh' <= 1`` and ``|h| / 2``): an assumption on XLA's ``tanh``, not a theorem.
"""

from __future__ import annotations

import flax.linen as nn
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings

from tests.support.tiled_models import SMALL, TiledBlockLM, init_params, lm_loss
from tests.support.tolerances import assert_rounds_once, gamma, unit_roundoff
from zinfjax import TiledDense, TiledMLP
from zinfjax.errors import ConfigError
from zinfjax.models import products, tiled_nnx
from zinfjax.models.tiled import (
    _fit,
    _probe_powers,
    default_kernel_init,
    fan_scale,
    spread_model,
    tile_kernel,
    untile_kernel,
)

SPLITS = [(1, 1), (2, 1), (1, 4), (2, 4)]
GELU_LIPSCHITZ, GELU_ULPS = 1.13, 16
ACTIVATIONS = {"relu": (nn.relu, 1.0, 0), "gelu": (nn.gelu, GELU_LIPSCHITZ, GELU_ULPS)}


def f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def normal(seed: int, shape) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def assert_within(got, want, bound) -> None:
    """``|got - want| <= bound``, value by value."""
    excess = np.abs(f64(got) - f64(want)) - bound
    assert np.all(excess <= 0), f"{int(np.sum(excess > 0))} values beyond the bound, by up to {excess.max():.2e}"


def rows_of(a: np.ndarray) -> np.ndarray:
    """``a`` as ``(rows, width)``: the leading axes flattened."""
    return f64(a).reshape(-1, a.shape[-1])


# ---- tile_kernel / untile_kernel --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=2), in_splits=st.integers(1, 4), in_t=st.integers(1, 3),
       out_splits=st.integers(1, 4), out_t=st.integers(1, 3))
def test_untile_inverts_tile_and_tile_t_is_block_i_j(lead, in_splits, in_t, out_splits, out_t):
    kernel = np.random.default_rng(0).standard_normal((*lead, in_splits * in_t, out_splits * out_t)).astype(np.float32)
    tiles = tile_kernel(kernel, in_splits, out_splits)
    assert tiles.shape == (*lead, in_splits * out_splits, in_t, out_t)
    np.testing.assert_array_equal(untile_kernel(tiles, in_splits, out_splits), kernel)
    for t in range(in_splits * out_splits):
        i, j = divmod(t, out_splits)
        block = kernel[..., i * in_t:(i + 1) * in_t, j * out_t:(j + 1) * out_t]
        np.testing.assert_array_equal(tiles[..., t, :, :], block)


def test_jax_arrays_tile_and_untile_bit_for_bit():
    kernel = normal(0, (3, 12, 8))
    tiles = tile_kernel(kernel, 3, 2)
    assert isinstance(tiles, jax.Array) and tiles.shape == (3, 6, 4, 4)
    np.testing.assert_array_equal(untile_kernel(tiles, 3, 2), kernel)


# ---- TiledDense against nn.Dense ---------------------------------------------------------------------


def dense_setup(in_splits: int, out_splits: int, n_in: int = 32, out: int = 16):
    """A TiledDense, its params (with a nonzero bias), an input ``(2, 5, n_in)`` and the untiled Dense params."""
    layer = TiledDense(out, in_splits=in_splits, out_splits=out_splits)
    x = normal(1, (2, 5, n_in))
    params = layer.init(jax.random.key(0), x)["params"]
    params = {**params, "bias": normal(2, (out,))}
    plain = {"kernel": untile_kernel(params["tiles"]["kernel"], in_splits, out_splits), "bias": params["bias"]}
    return layer, params, x, plain


@pytest.mark.numeric
@pytest.mark.parametrize("in_splits,out_splits", SPLITS)
def test_tiled_dense_is_dense_up_to_the_order_of_its_sums(in_splits, out_splits):
    layer, params, x, plain = dense_setup(in_splits, out_splits)
    assert params["tiles"]["kernel"].shape == (in_splits * out_splits, 32 // in_splits, 16 // out_splits)
    got, want = layer.apply({"params": params}, x), nn.Dense(16).apply({"params": plain}, x)
    magnitude = rows_of(np.abs(x)) @ np.abs(f64(plain["kernel"])) + np.abs(f64(plain["bias"]))
    assert_within(rows_of(got), rows_of(want), 2 * gamma(32 + 1) * magnitude)


@pytest.mark.numeric
@pytest.mark.parametrize("in_splits,out_splits", SPLITS)
def test_tiled_dense_gradients_are_denses(in_splits, out_splits):
    layer, params, x, plain = dense_setup(in_splits, out_splits)
    g = normal(3, (2, 5, 16))
    tiled = jax.grad(lambda p, x: jnp.sum(layer.apply({"params": p}, x) * g), argnums=(0, 1))(params, x)
    dense = jax.grad(lambda p, x: jnp.sum(nn.Dense(16).apply({"params": p}, x) * g), argnums=(0, 1))(plain, x)
    xs, gs, w = rows_of(x), rows_of(g), f64(plain["kernel"])
    rows = xs.shape[0]
    assert_within(untile_kernel(tiled[0]["tiles"]["kernel"], in_splits, out_splits), dense[0]["kernel"],
                  2 * gamma(rows) * np.abs(xs).T @ np.abs(gs))
    assert_within(tiled[0]["bias"], dense[0]["bias"], 2 * gamma(rows) * np.abs(gs).sum(0))
    assert_within(rows_of(tiled[1]), rows_of(dense[1]), 2 * gamma(16) * np.abs(gs) @ np.abs(w).T)


@pytest.mark.numeric
def test_dot_general_takes_each_tiles_product():
    """``products.dot_general`` reaches the tiles: its bf16 VJP is in the gradient, and each output is one bf16
    rounding of the exact product (``in_splits = 1``: one product per output block)."""
    layer = TiledDense(16, out_splits=4, use_bias=False, dtype=jnp.bfloat16, dot_general=products.dot_general)
    x = normal(1, (4, 32)).astype(jnp.bfloat16)
    params = layer.init(jax.random.key(0), x)["params"]
    loss = lambda p: jnp.sum(layer.apply({"params": p}, x).astype(jnp.float32))
    assert "custom_vjp_call" in str(jax.make_jaxpr(jax.grad(loss))(params))
    plain = TiledDense(16, out_splits=4, use_bias=False, dtype=jnp.bfloat16)
    plain_loss = lambda p: jnp.sum(plain.apply({"params": p}, x).astype(jnp.float32))
    assert "custom_vjp_call" not in str(jax.make_jaxpr(jax.grad(plain_loss))(params))
    kernel = untile_kernel(params["tiles"]["kernel"], 1, 4).astype(jnp.bfloat16)
    assert_rounds_once(layer.apply({"params": params}, x), x, kernel)


# ---- TiledMLP against the untiled MLP ----------------------------------------------------------------


class PlainMLP(nn.Module):
    """``act(x @ W_in + b_in) @ W_out + b_out`` with nn.Dense: the untiled MLP."""

    d_ff: int
    activation: object

    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1], name="out")(self.activation(nn.Dense(self.d_ff, name="in")(x)))


def mlp_setup(activation, tiles: int = 4, d: int = 16, d_ff: int = 64):
    """A TiledMLP, its params (nonzero biases), an input ``(2, 5, d)`` and the untiled MLP's params."""
    mlp = TiledMLP(d_ff, tiles, activation=activation)
    x = normal(1, (2, 5, d))
    params = mlp.init(jax.random.key(0), x)["params"]
    params = {"tiles": {**params["tiles"], "b_in": normal(2, (tiles, d_ff // tiles))}, "b_out": normal(3, (d,))}
    t = params["tiles"]
    plain = {"in": {"kernel": untile_kernel(t["w_in"], 1, tiles), "bias": t["b_in"].reshape(d_ff)},
             "out": {"kernel": untile_kernel(t["w_out"], tiles, 1), "bias": params["b_out"]}}
    return mlp, params, x, plain


def mlp_bounds(x, plain, lipschitz: float, ulps: int) -> dict:
    """How far one fp32 evaluation of the MLP may lie from the exact one: the pre-activation ``h``, its bound
    ``e_h``, the activation's bound ``e_a`` and the output's ``e_y``, over rows of ``x`` (float64)."""
    xs = rows_of(x)
    w_in, b_in, w_out, b_out = (f64(plain[k][n]) for k in ("in", "out") for n in ("kernel", "bias"))
    h = xs @ w_in + b_in
    e_h = gamma(xs.shape[1] + 1) * (np.abs(xs) @ np.abs(w_in) + np.abs(b_in))
    e_a = lipschitz * e_h + ulps * unit_roundoff("fp32") * np.abs(h) * (1 + h * h)
    a = np.maximum(h, 0) if ulps == 0 else f64(nn.gelu(jnp.asarray(h)))
    e_y = gamma(w_in.shape[1] + 1) * ((np.abs(a) + e_a) @ np.abs(w_out) + np.abs(b_out)) + e_a @ np.abs(w_out)
    return {"h": h, "a": a, "e_h": e_h, "e_a": e_a, "e_y": e_y}


@pytest.mark.numeric
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_tiled_mlp_is_the_untiled_mlp(name):
    activation, lipschitz, ulps = ACTIVATIONS[name]
    mlp, params, x, plain = mlp_setup(activation)
    got, want = mlp.apply({"params": params}, x), PlainMLP(64, activation).apply({"params": plain}, x)
    assert_within(rows_of(got), rows_of(want), 2 * mlp_bounds(x, plain, lipschitz, ulps)["e_y"])


@pytest.mark.numeric
def test_tiled_mlp_gradients_are_the_untiled_mlps():
    """ReLU: given the same mask, the backward pass is linear, and each gradient is a product of its own length
    (``d`` for dA, ``rows`` for the weights and biases, ``d_ff`` for dx) from operands with the forward's errors."""
    mlp, params, x, plain = mlp_setup(nn.relu)
    g = normal(4, (2, 5, 16))
    tiled = jax.grad(lambda p, x: jnp.sum(mlp.apply({"params": p}, x) * g), argnums=(0, 1))(params, x)
    ref = jax.grad(lambda p, x: jnp.sum(PlainMLP(64, nn.relu).apply({"params": p}, x) * g), argnums=(0, 1))(plain, x)
    b = mlp_bounds(x, plain, 1.0, 0)
    assert np.min(np.abs(b["h"]) - b["e_h"]) > 0, "a pre-activation within its error of ReLU's kink: draw again"
    xs, gs, rows = rows_of(x), rows_of(g), rows_of(x).shape[0]
    w_in, w_out = f64(plain["in"]["kernel"]), f64(plain["out"]["kernel"])
    mask = b["h"] > 0
    d_h = mask * (np.abs(gs) @ np.abs(w_out).T)  # bounds |dH|; e_dh bounds its error
    e_dh = mask * gamma(16) * d_h
    expect = {
        ("out", "kernel"): (untile_kernel(tiled[0]["tiles"]["w_out"], 4, 1),
                            gamma(rows) * (np.abs(b["a"]) + b["e_a"]).T @ np.abs(gs) + b["e_a"].T @ np.abs(gs)),
        ("out", "bias"): (tiled[0]["b_out"], gamma(rows) * np.abs(gs).sum(0)),
        ("in", "kernel"): (untile_kernel(tiled[0]["tiles"]["w_in"], 1, 4),
                           gamma(rows) * np.abs(xs).T @ (d_h + e_dh) + np.abs(xs).T @ e_dh),
        ("in", "bias"): (tiled[0]["tiles"]["b_in"].reshape(64), gamma(rows) * (d_h + e_dh).sum(0) + e_dh.sum(0)),
    }
    for (layer, name), (got, one) in expect.items():
        assert_within(got, ref[0][layer][name], 2 * one)
    e_dx = gamma(64) * (d_h + e_dh) @ np.abs(w_in).T + e_dh @ np.abs(w_in).T
    assert_within(rows_of(tiled[1]), rows_of(ref[1]), 2 * e_dx)


# ---- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build,message", [
    (lambda: TiledDense(16, in_splits=3).init(jax.random.key(0), jnp.ones((1, 32))),
     "in_splits=3 does not divide 32: use one of its divisors 1, 2, 4, 8, 16, 32"),
    (lambda: TiledDense(12, out_splits=5).init(jax.random.key(0), jnp.ones((1, 32))),
     "out_splits=5 does not divide 12: use one of its divisors 1, 2, 3, 4, 6, 12"),
    (lambda: TiledMLP(128, 3).init(jax.random.key(0), jnp.ones((1, 32))),
     "tiles=3 does not divide 128: use one of its divisors 1, 2, 4, 8, 16, 32, 64, 128"),
    (lambda: tiled_nnx.TiledDense(32, 16, in_splits=0, rngs=nnx.Rngs(0)), "in_splits=0 does not divide 32"),
    (lambda: tiled_nnx.TiledMLP(32, 128, 6, rngs=nnx.Rngs(0)), "tiles=6 does not divide 128"),
    (lambda: tile_kernel(np.zeros((6, 4)), 4, 1), "in_splits=4 does not divide 6: use one of its divisors 1, 2, 3, 6"),
    (lambda: untile_kernel(np.zeros((6, 2, 2)), 2, 2), "tiles of shape (6, 2, 2) are not 2 x 2 tiles"),
    (lambda: TiledDense(16, in_splits=2, kernel_init=nn.initializers.orthogonal()).init(jax.random.key(0),
                                                                                       jnp.ones((1, 32))),
     "whose spread is neither fixed nor variance scaling's"),
])
def test_a_split_that_does_not_divide_is_a_one_line_config_error(build, message):
    with pytest.raises(ConfigError) as raised:
        build()
    assert message in str(raised.value) and "\n" not in str(raised.value)


# ---- initialisation: a tile is a view of the whole layer ---------------------------------------------

INITS = {"lecun_normal": nn.initializers.lecun_normal(), "glorot_uniform": nn.initializers.glorot_uniform(),
         "he_fan_out": nn.initializers.variance_scaling(2.0, "fan_out", "truncated_normal"),
         "normal": nn.initializers.normal(0.02)}


@pytest.mark.numeric
@pytest.mark.parametrize("name", INITS)
def test_tiles_have_the_whole_kernels_variance(name):
    """The sample variances of ``N`` values each, tiled and untiled, differ by a relative ``sqrt((kappa - 1) (1/N +
    1/N))`` standard deviation (``kappa <= 3``, the normal's kurtosis, bounds these: truncated normal 2.4,
    uniform 1.8); 6 of those is the tolerance. A tile initialised with its own fans misses by a factor 2 to 4."""
    n_in, out, in_splits, out_splits = 512, 128, 4, 2
    x = jnp.ones((1, n_in))
    tiled = TiledDense(out, in_splits, out_splits, kernel_init=INITS[name]).init(jax.random.key(0), x)
    dense = nn.Dense(out, kernel_init=INITS[name]).init(jax.random.key(1), x)
    size = n_in * out
    ratio = float(jnp.var(tiled["params"]["tiles"]["kernel"]) / jnp.var(dense["params"]["kernel"]))
    assert abs(ratio - 1) <= 6 * np.sqrt(2 * 2 / size), ratio
    nnx_tiled = tiled_nnx.TiledDense(n_in, out, in_splits=in_splits, out_splits=out_splits, kernel_init=INITS[name],
                                     rngs=nnx.Rngs(2))
    assert abs(float(jnp.var(nnx_tiled.tiles.kernel[...]) / jnp.var(dense["params"]["kernel"])) - 1) <= \
        6 * np.sqrt(2 * 2 / size)


@pytest.mark.numeric
def test_fan_scale_is_the_ratio_of_the_variance_scaling_spreads():
    i = nn.initializers
    assert fan_scale(i.lecun_normal(), (1024, 256), (256, 128)) == 0.5  # fan_in 1024 against 256
    assert fan_scale(i.variance_scaling(1.0, "fan_out", "uniform"), (1024, 256), (256, 64)) == 0.5
    assert fan_scale(i.glorot_normal(), (300, 100), (100, 100)) == pytest.approx(np.sqrt(200 / 400), rel=1e-5)
    assert fan_scale(i.variance_scaling(1.0, "fan_geo_avg", "normal"), (64, 16), (16, 16)) == pytest.approx(
        np.sqrt(16 / 32), rel=1e-5)
    assert fan_scale(i.zeros, (64, 16), (16, 16)) == fan_scale(i.constant(0.5), (64, 16), (16, 16)) == 1.0
    probed, known = _fit(_probe_powers(default_kernel_init)), spread_model(default_kernel_init)  # up to a factor
    np.testing.assert_allclose(probed / probed.max(), known / known.max(), atol=1e-6)


# ---- NNX: the Linen modules' results for the same weights --------------------------------------------


@pytest.mark.numeric
@pytest.mark.parametrize("in_splits,out_splits", SPLITS)
def test_nnx_tiled_dense_is_the_linen_one(in_splits, out_splits):
    layer, params, x, plain = dense_setup(in_splits, out_splits)
    module = tiled_nnx.TiledDense(32, 16, in_splits=in_splits, out_splits=out_splits, rngs=nnx.Rngs(0))
    assert module.tiles.kernel.shape == params["tiles"]["kernel"].shape
    module.tiles.kernel.value, module.bias.value = params["tiles"]["kernel"], params["bias"]
    magnitude = rows_of(np.abs(x)) @ np.abs(f64(plain["kernel"])) + np.abs(f64(plain["bias"]))
    assert_within(rows_of(module(x)), rows_of(layer.apply({"params": params}, x)), 2 * gamma(33) * magnitude)


@pytest.mark.numeric
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_nnx_tiled_mlp_is_the_linen_one(name):
    activation, lipschitz, ulps = ACTIVATIONS[name]
    mlp, params, x, plain = mlp_setup(activation)
    module = tiled_nnx.TiledMLP(16, 64, 4, activation=activation, rngs=nnx.Rngs(0))
    for leaf in ("w_in", "b_in", "w_out"):
        assert getattr(module.tiles, leaf).shape == params["tiles"][leaf].shape
        getattr(module.tiles, leaf).value = params["tiles"][leaf]
    module.b_out.value = params["b_out"]
    assert_within(rows_of(module(x)), rows_of(mlp.apply({"params": params}, x)),
                  2 * mlp_bounds(x, plain, lipschitz, ulps)["e_y"])


# ---- a user's model: tiled MLPs nested in scanned blocks ---------------------------------------------


def test_a_model_with_tiled_mlps_in_scanned_blocks_trains():
    model = TiledBlockLM()
    params = init_params(model, jax.random.key(0))
    c = SMALL
    w_in = params["blocks"]["mlp"]["tiles"]["w_in"]
    assert w_in.shape == (c.n_layers, c.tiles, c.d_model, c.d_ff // c.tiles)
    tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, c.vocab)
    tx = optax.adam(1e-2)
    loss = lm_loss(model)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state, losses = tx.init(params), []
    for _ in range(5):
        params, opt_state, value = step(params, opt_state)
        losses.append(float(value))
    assert np.isclose(losses[0], np.log(c.vocab), rtol=0.2), losses
    assert losses[-1] < losses[0] - 0.1, losses
