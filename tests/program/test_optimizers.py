"""Exact for every optimizer it accepts: the per-unit update equals optax on the whole tree, or is refused by name.

`test_the_optimizer_table_holds` reads the table in docs/engine.md and checks each row on a real
program: GPT-2 (tiny) with stacked blocks and its vocabulary table in 3 padded row chunks. For each
unit (a layer, a chunk, a whole group) the plan's functions run sweep by sweep exactly as the engine
runs them, the partials combined between sweeps, and the result is compared with
``tx.update`` on the whole tree. A sum of per-slice partial sums rounds differently from one reduction, and XLA
fuses a slice's update apart from the whole tree's, so even one sweep may round its last bit differently: the
per-unit update and new state are no farther from the whole-tree update taken in float64 than the fp32 whole-tree
update is (tests/support/tolerances.py).
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zinfjax
from tests.support.engine_helpers import (
    assert_bitwise,
    batches,
    config,
    engine_run,
    exact_run,
    reference_run,
)
from tests.support.float64_twin import assert_float64
from tests.support.tolerances import assert_no_farther, assert_run_no_farther, gamma, in_float64
from zinfjax import models
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.program import NotStreamableError, UpdatePlan, program_for
from zinfjax.program.optimizer import combine_partials

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs", "engine.md")


def ndim_mask(tree):
    return jax.tree.map(lambda x: x.ndim > 1, tree)


def flip_layers():
    """A transformation that mixes the layers: each layer's update is another layer's gradient."""

    def update(updates, state, params=None):
        return jax.tree.map(lambda g: -1e-3 * jnp.flip(g, axis=0), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


OPTIMIZERS = {  # the first column of docs/engine.md's table -> the transformation
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "adamw masked by ndim > 1": lambda: optax.adamw(1e-3, weight_decay=0.1, mask=ndim_mask),
    "sgd momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "sgd nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-4, weight_decay=0.1),
    "adagrad": lambda: optax.adagrad(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lamb": lambda: optax.lamb(1e-3, weight_decay=0.01),
    "lars": lambda: optax.lars(1e-3),
    "novograd": lambda: optax.novograd(1e-3),
    "apply_if_finite(adam)": lambda: optax.apply_if_finite(optax.adam(1e-3), 3),
    "inject_hyperparams(adamw)": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, weight_decay=0.1),
    "MultiSteps(adam, 2)": lambda: optax.MultiSteps(optax.adam(1e-3), 2),
    "chain(clip_by_global_norm, adamw)": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "multi_transform by ndim": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-2)},
        lambda p: jax.tree.map(lambda x: "adam" if x.ndim > 2 else "sgd", p)),
    "adamw with warmup and cosine decay": lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0, 1e-3, 3, 20)),
    "a transformation that flips the layer axis": flip_layers,
}
# The float64 twin of a transformation that keeps a state in a fixed dtype: the same one, its state in float64.
EXACT_TWINS = {"MultiSteps(adam, 2)": lambda: optax.MultiSteps(optax.adam(1e-3), 2, accumulator_dtype=jnp.float64)}


def table_rows():
    with open(DOCS) as f:
        text = f.read()
    section = text[text.index("| optimizer | exact | sweeps | why |"):]
    rows = []
    for line in section.splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, exact, sweeps, _ = [c.strip() for c in line.strip("|").split("|")]
        rows.append((name.strip("`").replace("` ", " ").replace("`", ""), exact, sweeps))
    return rows


def test_the_table_names_every_optimizer_tested_here():
    assert [r[0] for r in table_rows()] == list(OPTIMIZERS)


@pytest.fixture(scope="module")
def probe():
    """GPT-2 (tiny) with its vocabulary in 3 padded chunks; random params and gradients of its whole tree."""
    model = models.build(models.ModelConfig.named("gpt2-tiny").replace(vocab_chunks=3))
    params = jax.jit(lm_init(model))(jax.random.key(0))
    program = program_for(lm_loss(model), params, jax.ShapeDtypeStruct((2, 17), jnp.int32))
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params)
    return program, params, grads


def _cut(plan, leaf, x, i):
    window = plan.window(leaf.group, i)
    return x if window is None else jax.lax.slice_in_dim(x, window.start, window.start + window.size, axis=0)


def sliced_update(plan, program, params, grads, state):
    """The per-unit update, sweep by sweep as the engine runs it; the new params and state, reassembled."""
    pf, gf = jax.tree.leaves(params), jax.tree.leaves(grads)
    sf = plan.state_tree.flatten_up_to(state)
    globals_ = [sf[s.index] for s in plan.globals]
    totals, new_p, new_s = {}, {}, {}
    for sweep in range(plan.sweeps):
        parts = {}
        for g in program.groups.values():
            for i in range(g.length):
                window = plan.window(g.name, i)
                fn = plan.unit(g.name, sweep, None if window is None else window.size)
                leaves = program.leaves_of(g.name)
                state_slices = [_cut(plan, program.leaves[s.param], sf[s.index], i) for s in plan.state_of(g.name)]
                out = fn([_cut(plan, x, pf[x.index], i) for x in leaves],
                         [_cut(plan, x, gf[x.index], i) for x in leaves], state_slices, globals_,
                         [totals[v] for v in plan.totals_before(sweep)], 0 if window is None else window.start)
                for c, value in zip(plan.crosses_of(g.name, sweep), out[0], strict=True):
                    parts.setdefault(c.out, []).append(value)
                if sweep == plan.sweeps - 1:  # earlier sweeps return partials only
                    for x, v in zip(leaves, out[1], strict=True):
                        new_p.setdefault(x.index, []).append(v)
                    for s, v in zip(plan.state_of(g.name), out[2], strict=True):
                        new_s.setdefault(s.index, []).append(v)
        totals.update(combine_partials([c for c in plan.crosses if c.phase == sweep], parts))
    new_globals = plan.finish()(globals_, [totals[c.out] for c in plan.crosses])
    flat_s = list(sf)
    for s, v in zip(plan.globals, new_globals, strict=True):
        flat_s[s.index] = v
    for k, vs in new_s.items():
        flat_s[k] = jnp.concatenate(vs) if len(vs) > 1 else vs[0]
    flat_p = [jnp.concatenate(new_p[k]) if len(new_p[k]) > 1 else new_p[k][0] for k in range(len(pf))]
    return jax.tree.unflatten(jax.tree.structure(params), flat_p), plan.state_tree.unflatten(flat_s)


# make test holds a row of each kind: elementwise, per-layer norms (novograd's 2 sweeps; adafactor's 3 run through the
# engine below), a global check (apply_if_finite), a global norm (chain), global state (MultiSteps), labels
# (multi_transform) and the refusal; make test-all holds every row.
WIDE_ROWS = {"lamb", "adafactor", "lars", "inject_hyperparams(adamw)", "adamw with warmup and cosine decay"}


@pytest.mark.numeric
@pytest.mark.parametrize("name,exact,sweeps", [pytest.param(*r, marks=pytest.mark.wide) if r[0] in WIDE_ROWS else r
                                               for r in table_rows()], ids=[r[0] for r in table_rows()])
def test_the_optimizer_table_holds(probe, name, exact, sweeps):
    program, params, grads = probe
    tx = OPTIMIZERS[name]()
    if exact == "no":
        with pytest.raises(NotStreamableError, match=r"rev mixes the slices of blocks.*one layer at a time"):
            UpdatePlan(tx, program)
        return
    plan = UpdatePlan(tx, program)
    assert plan.sweeps == int(sweeps)
    state = tx.init(params)
    for _ in range(2):  # two updates: the second starts from state the first one made
        want_p, want_s = jax.jit(lambda p, g, s: _whole(tx, p, g, s))(params, grads, state)
        got_p, got_s = sliced_update(plan, program, params, grads, state)
        with jax.enable_x64(True):  # the same whole-tree update in float64, from the same fp32 values
            tx64 = EXACT_TWINS.get(name, OPTIMIZERS[name])()  # made under x64: its dtypes are float64's
            exact_p, exact_s = jax.jit(functools.partial(_whole, tx64))(*in_float64((params, grads, state)))
            assert_float64(exact_p)
        # The step and the new state apart: the state (Adam's m, of the gradients' size) would hide the step.
        runs = ((exact_p, exact_s), (want_p, want_s), (got_p, got_s))
        longest = max(x.size // x.shape[0] if x.ndim > 1 else x.size for x in jax.tree.leaves(params))
        _no_farther_or_exact(*(_moved(params, p) for p, _ in runs), longest)
        _no_farther_or_exact(*(jax.tree.map(np.asarray, s) for _, s in runs), longest)
        params, state = want_p, want_s


def _whole(tx, params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _moved(start, new):
    """How far each parameter moved, in float64: the step an update takes."""
    return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), new, start)


def _l2(a, b) -> float:
    """Whole-tree relative L2 of ``b`` from ``a`` (every leaf counted; 0 where they agree, zeros included)."""
    num = sum(float(np.sum((np.float64(x) - np.float64(y)) ** 2))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    den = sum(float(np.sum(np.float64(x) ** 2)) for x in jax.tree.leaves(a))
    return 0.0 if num == 0 else (num / den) ** 0.5 if den else float("inf")


def _no_farther_or_exact(exact, reference, ours, longest: int) -> None:
    """``ours`` no farther from the float64 update than the fp32 whole-tree update is, or than ``gamma(longest)``:
    one update's norms and means (novograd, lamb, adafactor, clipping) sum up to a layer's ``longest`` values, and
    the order of such a sum alone moves it by up to that much (tests/support/tolerances.py). Where the fp32 update
    is exact (a step of zero, a state that copies the gradients), ``ours`` must be exact too."""
    if _l2(exact, reference) == 0:
        assert _l2(exact, ours) == 0
    else:
        assert_no_farther(exact, reference, ours, distance=_l2, floor=gamma(longest))


def test_a_refusal_names_the_operation_the_parameter_and_an_alternative(probe):
    program, _, _ = probe
    with pytest.raises(NotStreamableError) as err:
        UpdatePlan(flip_layers(), program)
    assert re.search(r"^rev mixes the slices of blocks along its streamed axis.*; use ", str(err.value))


@pytest.mark.numeric
@pytest.mark.parametrize("optimizer_name,weight_decay", [
    ("adamw", 0.01), pytest.param("sgd", 0.0, marks=pytest.mark.wide),
    pytest.param("lion", 0.01, marks=pytest.mark.wide),
    pytest.param("adam", 0.0, marks=pytest.mark.wide), pytest.param("adagrad", 0.0, marks=pytest.mark.wide),
    pytest.param("rmsprop", 0.0, marks=pytest.mark.wide), pytest.param("adamw", 0.1, marks=pytest.mark.wide),
])
def test_every_config_optimizer_through_the_engine_equals_the_in_memory_loop(tmp_path, optimizer_name, weight_decay):
    """20 steps at stage 1 on 2 devices, state on NVMe, with the schedule a user sets (warmup, cosine decay)."""
    c = config(optimizer_name=optimizer_name, weight_decay=weight_decay, stage=1, mesh="data:2", params="nvme",
               optimizer="nvme", nvme_path=str(tmp_path), warmup_steps=5, lr_decay="cosine", final_lr=1e-4)
    losses, params, _ = engine_run(c)
    numerics = config(optimizer_name=optimizer_name, weight_decay=weight_decay, mesh="data:2", warmup_steps=5,
                      lr_decay="cosine", final_lr=1e-4)  # the loop's: no tier, no stage
    assert_run_no_farther(exact_run(numerics), reference_run(c), (losses, params))
    assert losses[-1] < losses[0]


@pytest.mark.numeric
@pytest.mark.parametrize("steps", [5, pytest.param(10, marks=pytest.mark.wide)])
@pytest.mark.parametrize("optimizer_name", [pytest.param("lamb", marks=pytest.mark.wide), "adafactor"])
def test_engine_with_cross_layer_statistics_equals_the_in_memory_loop(tmp_path, optimizer_name, steps):
    """On NVMe at stage 2 on 4 devices, weight decay on: lamb and adafactor need 3 sweeps a step. make test runs 5
    steps; the wide form, for make test-all, 10."""
    c = config(optimizer_name=optimizer_name, weight_decay=0.01, stage=2, params="nvme", optimizer="nvme",
               nvme_path=str(tmp_path))
    losses, params, _ = engine_run(c, steps)
    numerics = config(optimizer_name=optimizer_name, weight_decay=0.01)  # the loop's: no tier, no stage
    assert_run_no_farther(exact_run(numerics, steps), reference_run(c, steps), (losses, params))


@pytest.mark.numeric
def test_wrap_keeps_the_optimizer_state_and_step_it_is_given(tmp_path):
    """5 steps in memory, then 5 through zinfjax, equal 10 steps in memory."""
    c = config(mesh="data:1", params="nvme", optimizer="nvme", nvme_path=str(tmp_path))
    model = models.build(c.model)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 4, 10), weight_decay=0.01)
    loss = lm_loss(model)
    state = train_state.TrainState.create(apply_fn=model.apply, params=jax.jit(lm_init(model))(jax.random.key(0)),
                                          tx=tx)
    step = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(loss)(s.params, b)))
    data = list(_take(batches(c), 10))
    ten = state
    for b in data:
        ten = step(ten, b)
    five = state
    for b in data[:5]:
        five = step(five, b)
    with jax.enable_x64(True):  # the 10 steps in memory in float64, from the same fp32 initial params
        loss64 = lm_loss(models.build(c.model, jnp.float64))
        step64 = jax.jit(lambda s, b: s.apply_gradients(grads=jax.grad(loss64)(s.params, b)))
        exact = train_state.TrainState.create(apply_fn=model.apply, params=in_float64(state.params), tx=tx)
        for b in data:
            exact = step64(exact, b)
        exact = jax.tree.map(np.asarray, exact.params)
    assert_float64(exact)
    with zinfjax.wrap(five, c) as wrapped:
        assert wrapped.step == 5
        for b in data[5:]:
            wrapped.train_step(b)
        assert wrapped.step == 10
        # No farther from the float64 loop than the 10 fp32 steps in memory are (tests/support/tolerances.py).
        assert_no_farther(exact, jax.tree.map(np.asarray, ten.params), wrapped.read_params())
        opt = wrapped.read_opt_state()
    counts = [x for x in jax.tree.leaves(opt) if jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(int(x) == 10 for x in counts)  # Adam's count and the schedule's: kept, not reset


def test_a_wrapped_opt_state_of_another_optimizer_is_refused_not_reset(tmp_path):
    c = config(mesh="data:1")
    model = models.build(c.model)
    params = jax.jit(lm_init(model))(jax.random.key(0))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    state = state.replace(opt_state=optax.sgd(1e-3, momentum=0.9).init(params))
    with pytest.raises(zinfjax.WrapError, match="opt_state does not have the structure"):
        zinfjax.wrap(state, c)


def _take(it, n):
    for _ in range(n):
        yield next(it)


def test_the_same_optimizer_on_every_tier_is_bitwise(tmp_path):
    """Sweeps run on every tier alike: lamb on NVMe equals lamb on device, bit for bit."""
    base = config(optimizer_name="lamb", mesh="data:2")
    device = engine_run(base, steps=4)
    nvme = engine_run(base.replace(params="nvme", optimizer="nvme", gradients="nvme", nvme_path=str(tmp_path)),
                      steps=4)
    assert device[0] == nvme[0]
    assert_bitwise(device[1], nvme[1])
