"""A GPT-2 with its first half frozen through ``optax.multi_transform``, or through ``zinfjax.wrap(trainable=...)``.

The model is zinfjax's GPT-2 pieces as a user would stack them: the embedding, a scan over the lower half of the
blocks, a scan over the upper half, the head. The embedding and the lower scan get ``optax.set_to_zero()``; the
rest AdamW. Through `zinfjax.wrap` with every tier on NVMe (and at stage 3 on 4 devices), against the plain
in-memory optax loop with the same mask: losses and trainable parameters no farther from the same loop run in
float64 (the blocks computing in float64, from the same fp32 initial parameters) than the fp32 loop is
(tests/support/tolerances.py), frozen ones bitwise as they started, and every chunk file of a frozen leaf
bitwise unchanged on disk (its sha256 after the first step, which fills the store, and at the end). As in
tests/test_any_model.py, at lr 1e-3, and the leaves whose true gradient is zero (the key bias: softmax is
invariant to it) are left out of the comparison: Adam turns their rounding noise into full-size steps in both
runs. The in-memory loop keeps each
block's matrix products for the backward and recomputes the rest (``nn.remat`` with `keep_products`), as the
engine's saved residuals and zinfjax's own reference trainer do: without it, XLA fuses the whole-model backward
its own way, and the runs part by 1.7e-6 after 6 steps (5.6e-7 with it).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zinfjax
from tests.support.engine_helpers import batches, config, relative_error
from tests.support.float64_twin import assert_float64, assert_products_in_float64
from tests.support.tolerances import assert_no_farther, assert_run_no_farther, in_float64, loss_distance
from tests.test_any_model import zero_gradient_leaves
from zinfjax.models import ModelConfig
from zinfjax.models.gpt import Block, Embed, Head
from zinfjax.program.residuals import keep_products
from zinfjax.trainers.frozen import FrozenError
from zinfjax.wrap import WrapError

CONFIG = ModelConfig.named("gpt2-tiny")
NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")
FROZEN = ("embed", "lower")


class Halves(nn.Module):
    """GPT-2 with its blocks in two scans: the lower and the upper half (``keep``: blocks that keep their products
    for the backward, the in-memory loop's)."""

    config: ModelConfig
    keep: bool = False
    dtype: Any = jnp.float32  # the compute dtype: float64 for the loop's exact twin

    def setup(self):
        c, dtype = self.config, self.dtype
        half = c.n_layers // 2
        block = nn.remat(Block, policy=keep_products, prevent_cse=False) if self.keep else Block
        self.embed = Embed(c, dtype)
        self.lower = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=half)(c, dtype)
        self.upper = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                             length=c.n_layers - half)(c, dtype)
        self.head = Head(c, dtype)

    def __call__(self, tokens, targets):
        h, _ = self.lower(self.embed(tokens), None)
        h, _ = self.upper(h, None)
        return self.head(h, self.embed.variables["params"], targets)


MODEL, KEEPING, EXACT = Halves(CONFIG), Halves(CONFIG, keep=True), Halves(CONFIG, keep=True, dtype=jnp.float64)
NOISE = {"['lower']['k']['bias']", "['upper']['k']['bias']"}  # a zero true gradient: Adam follows rounding noise


def loss_fn(params, batch):
    return MODEL.apply({"params": params}, batch[:, :-1], batch[:, 1:])


def keeping_loss(params, batch):
    return KEEPING.apply({"params": params}, batch[:, :-1], batch[:, 1:])


def exact_loss(params, batch):
    return EXACT.apply({"params": params}, batch[:, :-1], batch[:, 1:])


def tx(frozen=FROZEN):
    def label(params):
        return {k: jax.tree.map(lambda _, k=k: "frozen" if k in frozen else "train", v) for k, v in params.items()}

    return optax.multi_transform({"train": optax.adamw(1e-3), "frozen": optax.set_to_zero()}, label)


def data(steps: int):
    """The demo text's batches, as the other exactness tests train on."""
    source = batches(config(batch_size=8, seq_len=16))
    return [jnp.asarray(next(source)) for _ in range(steps)]


def initial():
    return MODEL.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32))["params"]


def own_loop(batches, frozen=FROZEN, t=None, loss_fn=keeping_loss, params=None):
    """The plain in-memory optax loop (``tx(frozen)`` unless ``t``) from the initial params: losses and params."""
    params, t = initial() if params is None else params, tx(frozen) if t is None else t
    opt = t.init(params)

    @jax.jit
    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt = t.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for b in batches:
        params, opt, loss = step(params, opt, b)
        losses.append(float(loss))
    return losses, params


def exact_loop(batches, frozen=FROZEN, t=None):
    """`own_loop` in float64, the blocks computing in float64, from the same fp32 initial params."""
    start = in_float64(initial())
    with jax.enable_x64(True):
        assert_products_in_float64(exact_loss, start, batches[0])
        losses, params = own_loop(batches, frozen, t, exact_loss, start)
        params = jax.tree.map(np.asarray, params)
    assert_float64(params)
    return losses, params


@functools.cache
def exact_run(steps: int, frozen=FROZEN):
    """`exact_loop` on ``data(steps)``, once per test process (the wide tests share the 20-step one)."""
    return exact_loop(data(steps), frozen)


def frozen_files(nvme: str) -> dict[str, str]:
    """sha256 of every chunk file of the frozen leaves' params stores."""
    out = {}
    for store in sorted(os.listdir(nvme)):
        if not store.startswith("params_") or not any(f in store for f in FROZEN):
            continue
        for here, _, files in os.walk(os.path.join(nvme, store)):
            for f in files:
                if f != "manifest.json" and "zarr" not in f:
                    with open(os.path.join(here, f), "rb") as fh:
                        out[os.path.join(here, f)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def flat(params) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def wrapped_run(batches, c, frozen=FROZEN, **how):
    t = tx(frozen) if not how else optax.adamw(1e-3)
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=initial(), tx=t)
    with zinfjax.wrap(state, c, loss_fn=loss_fn, **how) as w:
        losses = [float(w.train_step(batches[0])[1]["loss"])]
        before = frozen_files(c.nvme_path)
        losses += [float(w.train_step(b)[1]["loss"]) for b in batches[1:]]
        assert bool(w.engine.update_plan.frozen) == bool(frozen)  # found in the traced update
        params = w.sync()
        after = frozen_files(c.nvme_path)
    return losses, params, before, after


def follows(tmp_path, steps: int, frozen=FROZEN, **extra) -> tuple[list, list]:
    """The run through `zinfjax.wrap` follows the in-memory loop: its losses and trainable parameters are no farther
    from the loop in float64 than the fp32 loop is; the frozen ones stay bitwise. Returns the losses of the exact
    and the fp32 loop."""
    batches = data(steps)
    ref_losses, ref = own_loop(batches, frozen)
    exact_losses, exact = exact_run(steps, frozen)
    c = zinfjax.Config(nvme_path=str(tmp_path), **NVME, **extra)
    losses, ours, before, after = wrapped_run(batches, c, frozen)
    assert_no_farther(exact_losses, ref_losses, losses, loss_distance)
    start, ours, ref, exact = flat(initial()), flat(ours), flat(ref), flat(exact)
    noise = zero_gradient_leaves(loss_fn, initial(), batches[0])
    assert noise == NOISE
    held = [k for k in ours if frozen and k.startswith(tuple(f"['{f}']" for f in frozen))]
    train = [k for k in ours if k not in held and k not in noise]
    assert relative_error({k: start[k] for k in train}, {k: ours[k] for k in train}) > 1e-3  # they trained
    for k in held:
        np.testing.assert_array_equal(ours[k], start[k], err_msg=k)
    assert not frozen or (before and after == before)  # no frozen chunk rewritten
    assert_no_farther(*({k: t[k] for k in train} for t in (exact, ref, ours)))
    return exact_losses, ref_losses


@pytest.mark.numeric
@pytest.mark.slow
def test_the_first_half_frozen_through_multi_transform_is_exact_on_nvme(tmp_path):
    exact_losses, ref_losses = follows(tmp_path / "a", 6)
    c = zinfjax.Config(nvme_path=str(tmp_path / "b"), **NVME)
    losses, *_ = wrapped_run(data(6), c, trainable=lambda path, _: not path.startswith(FROZEN))
    assert_no_farther(exact_losses, ref_losses, losses, loss_distance)  # trainable= is the same mask


@pytest.mark.numeric
@pytest.mark.wide
def test_the_first_half_frozen_is_exact_over_20_steps_on_nvme(tmp_path):
    follows(tmp_path, 20)


@pytest.mark.numeric
@pytest.mark.wide
def test_freezing_adds_no_distance_at_stage_3_on_4_devices(tmp_path):
    """At stage 3 on 4 devices, with half of the model frozen and with none: each run is no farther from its loop in
    float64 than the fp32 loop is (the fc kernels part most: the fused whole-model backward against per-layer
    ones): freezing adds no distance of its own."""
    follows(tmp_path / "a", 20, stage=3, mesh="data:4")
    follows(tmp_path / "b", 20, frozen=(), stage=3, mesh="data:4")


def test_a_trainable_predicate_that_selects_nothing_or_everything_is_refused():
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=initial(), tx=optax.adam(1e-3))
    for pick, words in ((lambda p, _: False, "selects no parameter"), (lambda p, _: True, "selects every one")):
        with pytest.raises(FrozenError, match=words):
            zinfjax.wrap(state, zinfjax.Config(), loss_fn=loss_fn, trainable=pick)
    later = state.replace(step=3)
    with pytest.raises(WrapError, match="at step 3"):
        zinfjax.wrap(later, zinfjax.Config(), loss_fn=loss_fn, trainable=lambda p, _: "upper" in p)


def test_a_trainable_predicate_that_answers_other_than_true_or_false_is_refused():
    """``trainable`` returns True or False: a truthy "yes" (or 1) is no answer, refused in one line, not taken for
    True; numpy's bools are bools."""
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=initial(), tx=optax.adam(1e-3))
    for answer, shown in (("yes", "'yes' (str)"), (1, "1 (int)"), (None, "None (NoneType)")):
        with pytest.raises(TypeError, match=r"trainable\(path, leaf\) must return True or False; for '.+' it "
                                            rf"returned {re.escape(shown)}") as caught:
            zinfjax.wrap(state, zinfjax.Config(), loss_fn=loss_fn, trainable=lambda p, _, a=answer: a)
        assert isinstance(caught.value, FrozenError) and "\n" not in str(caught.value)
    zinfjax.wrap(state, zinfjax.Config(), loss_fn=loss_fn, trainable=lambda p, _: np.bool_("upper" in p)).close()


@pytest.mark.numeric
@pytest.mark.wide
def test_a_global_norm_over_every_leaf_still_counts_the_masked_gradients(tmp_path):
    """``chain(clip_by_global_norm, multi_transform(...))`` clips by the norm of every gradient, the masked
    leaves' included: those leaves get no update, but their gradients are needed, so nothing is frozen (and spared)
    and the run stays exact."""
    t = optax.chain(optax.clip_by_global_norm(0.05), tx())
    batches = data(3)
    ref, ref_params = own_loop(batches, t=t)
    exact, exact_params = exact_loop(batches, t=t)
    state = train_state.TrainState.create(apply_fn=MODEL.apply, params=initial(), tx=t)
    with zinfjax.wrap(state, zinfjax.Config(nvme_path=str(tmp_path), **NVME), loss_fn=loss_fn) as w:
        losses = [float(w.train_step(b)[1]["loss"]) for b in batches]
        assert not w.engine.update_plan.frozen
        params = w.sync()
    # No farther from the loop in float64 than the fp32 loop is (less the leaves of a zero true gradient).
    kept = [{k: v for k, v in flat(p).items() if k not in NOISE} for p in (exact_params, ref_params, params)]
    assert_run_no_farther((exact, kept[0]), (ref, kept[1]), (losses, kept[2]))
    assert abs(ref[-1] - own_loop(batches)[0][-1]) > 1e-6  # the clip acts: the masked gradients count
