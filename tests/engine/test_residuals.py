"""The backward from saved residuals (``recompute``): exact, lighter than it could be, and chosen by the budget.

``recompute=never`` keeps each layer's matrix products from the forward and runs only the VJP in the
backward; ``always`` reruns each layer's forward inside its backward, the activation checkpointing the
activation tier serves. Both are held to the reference trainer (tests/support/tolerances.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.engine_helpers import (
    batches,
    config,
    engine_run,
    engine_specs,
    exact_run,
    make_engine,
    reference_run,
)
from tests.support.float64_twin import assert_float64
from tests.support.tolerances import assert_no_farther, assert_run_no_farther, in_float64, loss_distance
from zinfjax import Config
from zinfjax.engine.budget import LIVE_PER_DEPTH, MemoryBudgetError, minimum_bytes
from zinfjax.engine.stores import budget_needs
from zinfjax.errors import ConfigError
from zinfjax.program.residuals import Pullback, apply_saved, save_vjp


def _layer(w, x, n):
    """A layer with a transposed weight, an integer input and an integer output."""
    h = jnp.tanh(x @ w)
    return jax.nn.gelu(h @ w.T) * n, jnp.argmax(h, -1)


@jax.jit
def _vjp(w, x, n, d_out):
    """``_layer``'s VJP at ``(w, x)``, as one ``jax.vjp``, forward and backward in one jitted function as the saved
    pullback's are (the VJP of an eager forward rounds otherwise: under the tests' fast compile, tanh and gelu
    fused with their derivatives lose 3 times more to fp32 than apart, in both)."""
    _, vjp = jax.vjp(lambda w, x: _layer(w, x, n), w, x)
    return vjp(d_out)


@pytest.mark.numeric
def test_the_saved_pullback_is_the_vjp_and_keeps_no_parameter():
    w = jax.random.normal(jax.random.key(0), (16, 16))
    x = jax.random.normal(jax.random.key(1), (4, 16))
    n = jnp.int32(3)
    d_out = (jax.random.normal(jax.random.key(2), (4, 16)), np.zeros((4,), jax.dtypes.float0))
    pullback = Pullback()

    @jax.jit
    def saved(w, x, n, d_out):
        _, kept = save_vjp(_layer, (w, x, n), [w], pullback)
        return kept, apply_saved(pullback, kept, [w], d_out)

    kept, (dw, dx, dn) = saved(w, x, n, d_out)
    want = _vjp(w, x, n, d_out)
    # XLA may fuse the kept products and the recomputed tanh otherwise than in one VJP: the saved pullback is no
    # farther from the VJP in float64 than the fp32 VJP is (tests/support/tolerances.py).
    with jax.enable_x64(True):
        exact = _vjp(*in_float64((w, x)), n, (in_float64(d_out[0]), d_out[1]))
        assert_float64(exact)
    assert_no_farther(jax.tree.map(np.asarray, exact), want, (dw, dx))
    assert dn.dtype == jax.dtypes.float0
    # Kept: the integer input, x and the two products (4 x 16 each); neither the weight nor its transpose.
    assert sorted(k.shape for k in kept) == [(), (4, 16), (4, 16), (4, 16)]


STEPS = 10  # the reference comparisons elsewhere run 20; these two modes run three times each case


def _never_and_always(c: Config, steps: int):
    never = engine_run(c.replace(recompute="never"), steps)
    always = engine_run(c.replace(recompute="always"), steps)
    return never, always


@pytest.mark.numeric
@pytest.mark.parametrize("keys,steps", [
    # make test runs 5 steps on nvme; the same over STEPS is wide, for make test-all
    (dict(params="nvme", optimizer="nvme", activations="nvme", stage=3), 5),
    pytest.param(dict(params="nvme", optimizer="nvme", activations="nvme", stage=3), STEPS, marks=pytest.mark.wide),
    # a wide corner: bf16 (test_mixed_precision) and micro-batches (test_engine_stages) run the saved path by default
    pytest.param(dict(precision="bf16", optimizer="host", grad_accum=2, mesh="data:2"), STEPS,
                 marks=[pytest.mark.wide, pytest.mark.low_precision]),
])
def test_saved_residuals_follow_the_reference_trainer(tmp_path, keys, steps):
    c = config(**keys, nvme_path=str(tmp_path / "nvme"))
    ref_losses, ref_params = reference_run(c, steps)
    (losses, params, metrics), (re_losses, re_params, re_metrics) = _never_and_always(c, steps)
    if c.precision == "fp32":  # each mode no farther from the loop in float64 than the fp32 loop is
        exact = exact_run(config(), steps)  # the loop depends on the numerics alone: test_exact.py's run
        assert_run_no_farther(exact, (ref_losses, ref_params), (losses, params))
        assert_run_no_farther(exact, (ref_losses, ref_params), (re_losses, re_params))
    else:  # the reference is fp32: the saved run loses no more to bf16 than the recomputing run does
        assert_no_farther(ref_params, re_params, params)
        assert_no_farther(ref_losses, re_losses, losses, loss_distance)
    assert losses[-1] < losses[0]
    assert all(m["residual_bytes"] > 0 for m in metrics) and all(m["residual_bytes"] == 0 for m in re_metrics)
    if c.activations == "nvme":  # the residuals replace the activation checkpoints
        assert all(m["read_bytes_nvme"] < r["read_bytes_nvme"] for m, r in zip(metrics, re_metrics, strict=True))


def test_the_bound_recompute_auto_counts_holds_what_a_step_keeps():
    c = config(recompute="never", optimizer="host")
    engine = make_engine(c)
    try:
        held = engine.train_step(next(batches(c)))["residual_bytes"]
        bound = engine.residual_bytes
    finally:
        engine.close()
    assert held <= bound <= 1.25 * held


# A batch whose residuals (about 250 MB) dwarf how much the process's own memory moves between engines.
LARGE = dict(optimizer="host", batch_size=64, seq_len=128)


def _least(engine) -> tuple[int, int, int]:
    """The minimum budget of ``engine`` without residuals (`minimum_bytes`), and its write and read bytes."""
    specs, acts = engine_specs(engine)
    read, write, resident = budget_needs(specs, list(acts.values()), "cpu")
    return minimum_bytes(engine.budget.baseline, resident, read, write), write, read


@pytest.fixture(scope="module")
def sizes():
    """``(least, write, read, residuals)`` of the LARGE configuration, from an engine that recomputes."""
    engine = make_engine(config(**LARGE, recompute="always"))
    try:
        return (*_least(engine), engine.residual_bytes)
    finally:
        engine.close()


def test_auto_keeps_residuals_only_while_the_budget_stays_roomy(sizes):
    least, write, read, residuals = sizes
    assert residuals > 200 << 20
    roomy_without = least + 2 * write + LIVE_PER_DEPTH * read  # the least budget that is not lean
    for limit, saves in ((roomy_without + residuals + residuals // 2, True), (roomy_without + residuals // 2, False)):
        engine = make_engine(config(**LARGE, memory_limit=limit))
        try:
            assert engine.saves_residuals == saves and not engine.budget.lean
        finally:
            engine.close()


def test_never_is_refused_in_one_line_when_the_residuals_do_not_fit(sizes):
    least, _, _, residuals = sizes
    with pytest.raises(MemoryBudgetError, match=r"recompute=never keeps .* of residuals") as e:
        make_engine(config(**LARGE, recompute="never", memory_limit=least + residuals // 2))
    assert "\n" not in str(e.value)


def test_an_unknown_recompute_is_refused():
    with pytest.raises(ConfigError, match="recompute='sometimes' is not allowed; use auto, always, never"):
        Config(recompute="sometimes")
