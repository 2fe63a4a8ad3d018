"""Any Flax model through `zinfjax.wrap(state, config, loss_fn=...)`: the examples' own models, streamed exactly.

For each example model (a Linen ViT with a class token, a Linen BERT masked LM with an attention
mask and dropout, an NNX Llama with `nnx.scan` blocks), 10 steps through `wrap` with every tier
on NVMe equal the plain in-memory optax loop over the same `loss_fn`, the same batches and the
same keys: no farther from the same loop run in float64 than the fp32 loop is (parameters: whole-tree
relative L2, ``SLACK``; losses: ``LOSS_SLACK``; tests/support/tolerances.py), at the learning rate of the
other exactness tests (1e-3: Adam carries a gradient's rounding noise as far as the learning rate).
The float64 twin is the same loop under ``jax.enable_x64`` from the same fp32 initial parameters: the
examples' Flax layers take no ``dtype`` and so compute in their inputs' and parameters' (float64), and
dropout draws the fp32 run's masks (`float32_dropout_masks`).

Leaves whose true gradient is zero (an attention key bias shifts every score of a softmax row
alike) are left out of the parameter comparison and named: Adam turns their rounding noise into
full-size steps in both runs, so they follow noise alone. `zero_gradient_leaves` finds them
from the gradient itself, not from a list.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinfjax
from examples import bert_mlm_linen, llama_nnx, vit_linen
from tests.support.tolerances import assert_no_farther, in_float64, loss_distance
from zinfjax.config import parse_mesh
from zinfjax.data import Batches, load_tokens
from zinfjax.sharding import batch_sharding, make_mesh, replicated
from zinfjax.trainers.reference import micro_batches

pytestmark = pytest.mark.numeric
STEPS = 10
NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")


def step_key(seed: int, step: int, accum: int, a: int):
    """The key zinfjax gives micro-batch ``a`` of step ``step`` (docs/models.md, "Dropout")."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return key if accum == 1 else jax.random.fold_in(key, a)


def in_memory_loop(loss_fn, params, tx, batches, with_rng=False, accum=1, seed=0, mesh="data:1"):
    """The plain optax loop, data-parallel on ``mesh`` as the wrapped run: mean loss and gradients over micro-batches
    (rows ``a::accum``), jitted with the parameters replicated and the batch split over ``data``."""
    mesh = make_mesh(parse_mesh(mesh))
    rep, rows = replicated(mesh), batch_sharding(mesh)
    params = jax.device_put(params, rep)
    opt = jax.device_put(tx.init(params), rep)

    @functools.partial(jax.jit, in_shardings=(rep, rep, rows, None), out_shardings=(rep, rep, rep))
    def step(params, opt, batch, n):
        parts = micro_batches(batch, accum)
        losses, grads = [], []
        for a in range(accum):
            micro = jax.tree.map(lambda x, a=a: x[a], parts)
            args = (params, micro, step_key(seed, n, accum, a)) if with_rng else (params, micro)
            loss, g = jax.value_and_grad(loss_fn)(*args)
            losses.append(loss)
            grads.append(g)
        grads = jax.tree.map(lambda *g: jnp.mean(jnp.stack(g), axis=0), *grads)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, jnp.mean(jnp.stack(losses))

    out = []
    for n, batch in enumerate(batches, start=1):
        params, opt, loss = step(params, opt, batch, n)
        out.append(float(loss))
    return out, params


def zero_gradient_leaves(loss_fn, params, batch, with_rng=False) -> set[str]:
    """Leaves whose gradient at ``params`` is zero up to rounding (below 1e-5 of the largest leaf's)."""
    args = (params, batch, jax.random.key(0)) if with_rng else (params, batch)
    grads = jax.grad(loss_fn)(*args)
    norms = {jax.tree_util.keystr(p): float(jnp.linalg.norm(g)) for p, g in jax.tree_util.tree_leaves_with_path(grads)}
    top = max(norms.values())
    return {k for k, v in norms.items() if v < 1e-5 * top}


def relative_l2(a, b, skip: set[str]) -> float:
    pairs = [(x, y) for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True)
             if jax.tree_util.keystr(p) not in skip]
    num = sum(float(np.sum((np.float64(x) - np.float64(y)) ** 2)) for x, y in pairs)
    return (num / sum(float(np.sum(np.float64(x) ** 2)) for x, _ in pairs)) ** 0.5


@contextlib.contextmanager
def float32_dropout_masks():
    """Dropout under ``jax.enable_x64`` with the fp32 run's masks.

    ``jax.random.bernoulli`` draws its uniforms in ``p``'s dtype, and Flax passes ``p`` as a Python float: float64
    under x64, other bits, another mask. Drawn in float32, the masks are the fp32 run's
    (`test_float32_dropout_masks_are_the_fp32_runs`).
    """
    bernoulli = jax.random.bernoulli

    def same_mask(key, p=0.5, shape=None, mode="low", **kw):
        return bernoulli(key, jnp.asarray(p, jnp.float32), shape, mode, **kw)

    jax.random.bernoulli = same_mask
    try:
        yield
    finally:
        jax.random.bernoulli = bernoulli


def exact_loop(loss_fn, params, tx, batches, with_rng=False, **kw):
    """`in_memory_loop` in float64 from the same fp32 initial ``params`` (and the batches' floats in float64): the
    run the fp32 loops are judged against (tests/support/tolerances.py)."""
    with jax.enable_x64(True), float32_dropout_masks():
        params, batches = in_float64(params), in_float64(batches)
        args = (params, batches[0], jax.random.key(0)) if with_rng else (params, batches[0])
        assert jax.eval_shape(loss_fn, *args).dtype == jnp.float64  # no silent fp32 cast in the model
        losses, out = in_memory_loop(loss_fn, params, tx, batches, with_rng=with_rng, **kw)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(out))
        return losses, jax.tree.map(np.asarray, out)


def assert_exact(exact, losses, ref_losses, params, ref_params, skip):
    """zinfjax's run no farther from the float64 run than the fp32 loop is: parameters (less ``skip``, the leaves
    whose true gradient is zero) within ``SLACK``, losses within ``LOSS_SLACK``."""
    exact_losses, exact_params = exact
    print(f"left out of the parameters, zero true gradient: {sorted(skip)}")
    assert_no_farther(exact_params, jax.tree.map(np.asarray, ref_params), params,
                      lambda a, b: relative_l2(a, b, skip))
    assert_no_farther(exact_losses, ref_losses, losses, loss_distance)
    assert losses[-1] < losses[0]


def test_float32_dropout_masks_are_the_fp32_runs():
    key = jax.random.key(3)
    want = jax.random.bernoulli(key, 0.9, (4096,))
    with jax.enable_x64(True):
        assert not np.array_equal(jax.random.bernoulli(key, 0.9, (4096,)), want)  # the trap
        with float32_dropout_masks():
            np.testing.assert_array_equal(jax.random.bernoulli(key, 0.9, (4096,)), want)


@pytest.mark.wide
def test_vit_at_stage3_on_8_devices_with_accumulation(tmp_path):
    config = vit_linen.SIZES["tiny"]
    tx = optax.adamw(1e-3, weight_decay=0.01)
    state, _ = vit_linen.make_state(config, tx)
    loss_fn = vit_linen.make_loss(state)
    batches = [vit_linen.batch_of(config, 16, n) for n in range(STEPS)]
    ref_losses, ref_params = in_memory_loop(loss_fn, state.params, tx, batches, accum=2, mesh="data:8")
    exact = exact_loop(loss_fn, state.params, tx, batches, accum=2, mesh="data:8")
    c = zinfjax.Config(stage=3, mesh="data:8", grad_accum=2, nvme_path=str(tmp_path), **NVME)
    with zinfjax.wrap(state, c, loss_fn=loss_fn) as wrapped:
        losses = [wrapped.train_step(b)[1]["loss"] for b in batches]
        params = jax.tree.map(np.asarray, wrapped.read_params())
        assert wrapped.engine.stores.params["s:blocks"].tier == "nvme"
    assert_exact(exact, losses, ref_losses, params, ref_params, zero_gradient_leaves(loss_fn, state.params, batches[0]))


@pytest.mark.wide
def test_bert_masked_lm_with_dropout_keys_and_an_attention_mask(tmp_path):
    config = bert_mlm_linen.BertConfig()
    tx = optax.adamw(1e-3)
    state = bert_mlm_linen.make_state(config, tx)
    loss_fn = bert_mlm_linen.make_loss(state)
    tokens = load_tokens("demo")
    batches = [bert_mlm_linen.batch_of(config, 8, n, tokens) for n in range(STEPS)]
    ref_losses, ref_params = in_memory_loop(loss_fn, state.params, tx, batches, with_rng=True, seed=7, mesh="data:2")
    exact = exact_loop(loss_fn, state.params, tx, batches, with_rng=True, seed=7, mesh="data:2")
    c = zinfjax.Config(mesh="data:2", seed=7, nvme_path=str(tmp_path), **NVME)
    with zinfjax.wrap(state, c, loss_fn=loss_fn) as wrapped:
        losses = [wrapped.train_step(b)[1]["loss"] for b in batches]
        params = jax.tree.map(np.asarray, wrapped.read_params())
    skip = zero_gradient_leaves(loss_fn, state.params, batches[0], with_rng=True)
    assert_exact(exact, losses, ref_losses, params, ref_params, skip)
    # Dropout is on: the same batch under another key gives another loss.
    assert loss_fn(ref_params, batches[0], jax.random.key(1)) != loss_fn(ref_params, batches[0], jax.random.key(2))


def test_llama_nnx_with_scanned_blocks_at_stage2(tmp_path):
    config = llama_nnx.LlamaConfig()
    tx = optax.adamw(1e-3)
    model = llama_nnx.Llama(config, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pure = params.to_pure_dict()

    def pure_loss_of(graphdef):
        def pure_loss(p, batch):
            s = jax.tree.map(lambda x: x, params)
            s.replace_by_pure_dict(p)
            return llama_nnx.loss_fn(nnx.merge(graphdef, s, rest), batch)

        return pure_loss

    wide = nnx.clone(model)  # the float64 twin: every module that takes a compute dtype (nnx.Embed) in float64
    for _, module in nnx.iter_modules(wide):
        if getattr(module, "dtype", None) is not None:
            module.dtype = jnp.float64
    data = Batches(load_tokens("demo"), 8, 32, seed=0)
    batches = [next(data) for _ in range(STEPS)]
    ref_losses, ref_params = in_memory_loop(pure_loss_of(graphdef), pure, tx, batches, mesh="data:4")
    exact = exact_loop(pure_loss_of(nnx.split(wide, nnx.Param, ...)[0]), pure, tx, batches, mesh="data:4")
    c = zinfjax.Config(stage=2, mesh="data:4", nvme_path=str(tmp_path), **NVME)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    with zinfjax.wrap(optimizer, c, model=model, loss_fn=llama_nnx.loss_fn) as wrapped:
        losses = [wrapped.train_step(b)[1]["loss"] for b in batches]
        params_after = jax.tree.map(np.asarray, wrapped.sync())
    assert_exact(exact, losses, ref_losses, params_after, ref_params, set())
    synced = nnx.state(model, nnx.Param).to_pure_dict()
    for a, b in zip(jax.tree.leaves(synced), jax.tree.leaves(params_after), strict=True):
        np.testing.assert_array_equal(a, b)
