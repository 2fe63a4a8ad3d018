"""Layers whose blocks scan again over tiles stream tile by tile, exactly (`zinfjax.program.nested`).

A Linen model whose blocks (an ``nn.scan`` over layers) each run their MLP as an ``nn.scan`` over
four tiles of its hidden dimension: through `zinfjax.wrap`, every tile is a unit of its own (read,
updated and written alone), and the run equals the plain in-memory optax loop over the same
``loss_fn`` and batches: losses and parameters (whole-tree relative L2, less the leaves of a zero true
gradient) no farther from the same loop run in float64 than the fp32 loop is, as every engine path is held
(tests/support/tolerances.py). The order of the operations does not depend on where the state lives, so the
tiers agree bit for bit.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zinfjax
from tests.support import tiled_models
from tests.support.float64_twin import assert_float64, assert_products_in_float64, nnx_in_float64
from tests.support.nnx_models import StackedLM, next_token_loss
from tests.support.tolerances import assert_no_farther, in_float64, loss_distance
from tests.test_any_model import in_memory_loop, zero_gradient_leaves
from zinfjax.models.tiled_nnx import TiledMLP as TiledMLPNNX
from zinfjax.program.split import ProgramError, split

LAYERS, TILES, STEPS = 2, 4, 5


class Tile(nn.Module):
    """One tile of an MLP: ``acc + gelu(h W_in[:, t] + b_in[t]) W_out[t, :]``."""

    d: int
    f: int

    @nn.compact
    def __call__(self, acc, h):
        u = nn.gelu(nn.Dense(self.f, name="w_in")(h))
        return acc + nn.Dense(self.d, use_bias=False, name="w_out")(u), None


class Block(nn.Module):
    d: int
    tiles: int
    reuse_tile: bool = False  # a bad model: its tile kernels also read whole, outside their scan

    @nn.compact
    def __call__(self, x, _):
        x = x + nn.Dense(self.d, name="attn")(nn.LayerNorm(name="ln")(x))
        h = nn.LayerNorm(name="ln2")(x)
        tiles = nn.scan(Tile, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                        length=self.tiles)(self.d, 4 * self.d // self.tiles, name="mlp")
        acc, _ = tiles(jnp.zeros_like(x), h)
        if self.reuse_tile:
            acc = acc + jnp.sum(self.variables["params"]["mlp"]["w_out"]["kernel"])
        return x + acc + self.param("b_out", nn.initializers.zeros, (self.d,))[None, None], None


class TiledLM(nn.Module):
    vocab: int = 64
    d: int = 32
    tiles: int = TILES
    reuse_tile: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d, name="wte")(tokens)
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        x, _ = blocks(self.d, self.tiles, self.reuse_tile, name="blocks")(x, None)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="lnf")(x))


def make_loss(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], -1))

    return loss_fn


def batches(n: int = STEPS, rows: int = 8):
    """Two random batches in turn: enough for the loss to fall within a few steps."""
    rng = np.random.default_rng(0)
    two = [{k: jnp.asarray(rng.integers(0, 64, (rows, 16)), jnp.int32) for k in ("x", "y")} for _ in range(2)]
    return [two[n % 2] for n in range(n)]


def _distance(skip: set[str]):
    """Whole-tree relative L2, less the leaves in ``skip`` (a zero true gradient: Adam follows rounding noise)."""
    def distance(a, b):
        pairs = [(x, y) for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True)
                 if jax.tree_util.keystr(p) not in skip]
        num = sum(float(np.sum((np.float64(x) - np.float64(y)) ** 2)) for x, y in pairs)
        return (num / sum(float(np.sum(np.float64(x) ** 2)) for x, _ in pairs)) ** 0.5

    return distance


def assert_follows(losses, params, loss_fn, start, tx, data, exact_loss=None, **loop):
    """The wrapped run's ``losses`` and ``params`` are no farther from the in-memory loop (`in_memory_loop` of
    ``loss_fn`` from ``start``) run in float64 than the fp32 loop is; ``exact_loss`` is ``loss_fn`` computing in
    float64 where ``loss_fn`` fixes its own dtype."""
    ref_losses, ref_params = in_memory_loop(loss_fn, start, tx, data, **loop)
    exact_loss = exact_loss or loss_fn
    with jax.enable_x64(True):  # the same loop in float64, from the same fp32 initial parameters
        start64 = in_float64(start)
        assert_products_in_float64(exact_loss, start64, data[0])
        exact_losses, exact = in_memory_loop(exact_loss, start64, tx, data, **loop)
        exact = jax.tree.map(np.asarray, exact)
    assert_float64(exact)
    distance = _distance(zero_gradient_leaves(loss_fn, start, data[0]))
    assert_no_farther(exact, jax.tree.map(np.asarray, ref_params), params, distance)
    assert_no_farther(exact_losses, ref_losses, losses, loss_distance)
    assert losses[-1] < losses[0]


def wrapped_run(model, tx, data, tmp_path, tier="nvme", **config):
    params = model.init(jax.random.key(0), data[0]["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    tiers = dict(params=tier, optimizer=tier, gradients=tier, activations=tier)
    c = zinfjax.Config(nvme_path=str(tmp_path / tier), **tiers, **{"stream_tiles": "always", **config})
    with zinfjax.wrap(state, c, loss_fn=make_loss(model)) as wrapped:
        losses = [wrapped.train_step(b)[1]["loss"] for b in data]
        groups = {g.name: g.length for g in wrapped.engine.program.streamed_groups()}
        stores = {name: s.tier for name, s in wrapped.engine.stores.params.items()}
        return params, losses, jax.tree.map(np.asarray, wrapped.read_params()), groups, stores


@pytest.mark.numeric
@pytest.mark.slow
def test_each_tile_is_a_unit_and_the_run_is_the_in_memory_loop(tmp_path):
    model, tx, data = TiledLM(), optax.adamw(1e-3, weight_decay=0.01), batches()
    params, losses, out, groups, stores = wrapped_run(model, tx, data, tmp_path)
    assert groups == {"s:blocks.layer": LAYERS, "s:blocks.tiles1": LAYERS * TILES}
    assert set(stores.values()) == {"nvme"}
    assert_follows(losses, out, make_loss(model), params, tx, data)
    _, host_losses, host_out, _, _ = wrapped_run(model, tx, data, tmp_path, tier="host")
    assert host_losses == losses  # bit for bit: the tier does not change the order of the operations
    for a, b in zip(jax.tree.leaves(host_out), jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.numeric
@pytest.mark.wide
def test_tiles_at_stage_3_on_4_devices_with_accumulation(tmp_path):
    model, tx, data = TiledLM(), optax.adam(1e-3), batches()
    params, losses, out, _, _ = wrapped_run(model, tx, data, tmp_path, stage=3, mesh="data:4", grad_accum=2)
    assert_follows(losses, out, make_loss(model), params, tx, data, accum=2, mesh="data:4")


@pytest.mark.numeric
@pytest.mark.wide
def test_an_optimizer_of_several_sweeps_spools_each_tile(tmp_path):
    """lamb's trust ratio needs each leaf's norm over every tile of every layer: a second sweep."""
    model, tx, data = TiledLM(), optax.lamb(1e-2), batches(3)
    params, losses, out, _, _ = wrapped_run(model, tx, data, tmp_path)
    assert_follows(losses, out, make_loss(model), params, tx, data)


def test_a_tile_leaf_read_outside_its_tile_scan_is_refused_by_name():
    model, data = TiledLM(reuse_tile=True), batches(1)
    params = model.init(jax.random.key(0), data[0]["x"])["params"]
    with pytest.raises(ProgramError, match="parameter blocks/mlp/w_out/kernel is used both one layer at a time"):
        split(make_loss(model), params, data[0])


@pytest.mark.numeric
@pytest.mark.slow
def test_tiled_mlp_layers_of_linen_stream_tile_by_tile_through_wrap(tmp_path):
    """`zinfjax.TiledMLP` inside ``nn.scan`` blocks (`tests.support.tiled_models`), through `zinfjax.wrap` on NVMe."""
    model, tx = tiled_models.TiledBlockLM(), optax.adamw(1e-3)
    params = tiled_models.init_params(model, jax.random.key(0), seq_len=16)
    loss_fn = tiled_models.lm_loss(model)
    rng = np.random.default_rng(1)
    data = [jnp.asarray(rng.integers(0, 64, (8, 17)), jnp.int32)] * STEPS
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    c = zinfjax.Config(nvme_path=str(tmp_path), params="nvme", optimizer="nvme", gradients="nvme", activations="nvme",
                       stream_tiles="always")
    with zinfjax.wrap(state, c, loss_fn=loss_fn) as wrapped:
        losses = [wrapped.train_step(b)[1]["loss"] for b in data]
        groups = {g.name: g.length for g in wrapped.engine.program.streamed_groups()}
        out = jax.tree.map(np.asarray, wrapped.read_params())
    assert max(groups.values()) == tiled_models.SMALL.n_layers * tiled_models.SMALL.tiles, groups
    assert_follows(losses, out, loss_fn, params, tx, data)


class NNXBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = TiledMLPNNX(d, 4 * d, TILES, rngs=rngs)

    def __call__(self, h):
        return h + self.mlp(self.norm(h))


def pure_loss_of(model):
    """``loss(params, batch)`` of the NNX ``model`` on a pure dict of its params, and that dict."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def pure_loss(p, batch):
        s = jax.tree.map(lambda x: x, params)
        s.replace_by_pure_dict(p)
        return next_token_loss(nnx.merge(graphdef, s, rest), batch)

    return pure_loss, params.to_pure_dict()


def nnx_tiled_lm(rngs: nnx.Rngs, d: int = 32):
    """`StackedLM` whose blocks each hold a `zinfjax.models.tiled_nnx.TiledMLP` (a nested scan)."""
    return StackedLM(lambda r: NNXBlock(d, r), LAYERS, 64, d, rngs)


@pytest.mark.numeric
@pytest.mark.wide
def test_nnx_blocks_with_a_tiled_mlp_stream_tile_by_tile_through_wrap(tmp_path):
    model, tx = nnx_tiled_lm(nnx.Rngs(0)), optax.adam(1e-3)
    pure_loss, pure = pure_loss_of(model)
    with jax.enable_x64(True):  # NNX's Embed computes in its param dtype unless told: the twin is told float64
        exact_loss, _ = pure_loss_of(nnx_in_float64(model))
    rng = np.random.default_rng(2)
    data = [jnp.asarray(rng.integers(0, 64, (8, 17)), jnp.int32)] * STEPS
    c = zinfjax.Config(nvme_path=str(tmp_path), params="nvme", optimizer="nvme", gradients="nvme", activations="nvme",
                       stream_tiles="always")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    with zinfjax.wrap(optimizer, c, model=model, loss_fn=next_token_loss) as wrapped:
        losses = [wrapped.train_step(b)[1]["loss"] for b in data]
        groups = {g.name: g.length for g in wrapped.engine.program.streamed_groups()}
        out = jax.tree.map(np.asarray, wrapped.sync())
    assert max(groups.values()) == LAYERS * TILES
    assert_follows(losses, out, pure_loss, pure, tx, data, exact_loss)


class DenseBlock(nn.Module):
    """A residual block around a `zinfjax.TiledDense` of 2 x 2 tiles (TiledLinear's in_splits and out_splits)."""

    d: int = 32

    @nn.compact
    def __call__(self, x, _):
        h = nn.gelu(zinfjax.TiledDense(4 * self.d, in_splits=2, out_splits=2, name="up")(nn.LayerNorm(name="ln")(x)))
        return x + zinfjax.TiledDense(self.d, in_splits=4, out_splits=1, name="down")(h), None


class DenseLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32, name="wte")(tokens)
        x, _ = nn.scan(DenseBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)(
            name="blocks")(x, None)
        return nn.Dense(64, name="head")(x)


@pytest.mark.numeric
@pytest.mark.wide
def test_tiled_dense_layers_stream_tile_by_tile_through_wrap(tmp_path):
    model, tx, data = DenseLM(), optax.adamw(1e-3), batches()
    params, losses, out, groups, _ = wrapped_run(model, tx, data, tmp_path)
    assert sorted(n for n, length in groups.items() if length == LAYERS * 4) == ["s:blocks.tiles1", "s:blocks.tiles3"]
    assert_follows(losses, out, make_loss(model), params, tx, data)


@pytest.mark.numeric
@pytest.mark.parametrize("recompute", ["always", pytest.param("never", marks=pytest.mark.wide)])
def test_tiles_with_and_without_recomputation(tmp_path, recompute):
    """Each body stage's and tile's backward reruns its forward, or takes the forward's saved residuals (what the
    other tests of this file run: the budget holds them; ``never`` insists, under ``wide``)."""
    model, tx, data = TiledLM(), optax.adam(1e-3), batches()
    params, losses, out, _, _ = wrapped_run(model, tx, data, tmp_path, recompute=recompute)
    assert_follows(losses, out, make_loss(model), params, tx, data)
