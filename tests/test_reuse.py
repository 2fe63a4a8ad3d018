"""Parameters kept from the forward for the backward (``max_reuse_distance``): exact, fewer reads, budgeted."""

import pytest

from tests.engine_helpers import assert_bitwise, config, engine_run, make_engine
from zinfjax import Config
from zinfjax.engine import reuse
from zinfjax.engine.budget import MemoryBudgetError, minimum_bytes
from zinfjax.engine.engine import store_specs
from zinfjax.engine.store_plan import budget_needs
from zinfjax.errors import ConfigError


def test_reuse_reads_less_and_is_bitwise_the_run_without(tmp_path):
    c = config(stage=3, params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "nvme"), max_reuse_distance=10**9)
    losses, params, metrics = engine_run(c, steps=5)
    none_losses, none_params, none_metrics = engine_run(c.replace(max_reuse_distance=None), steps=5)
    # The kept tree is the one the forward read: the backward computes on the same values, so a run with
    # reuse is bitwise the run without, which test_engine_exact holds to the reference trainer.
    assert losses[-1] < losses[0]
    assert losses == none_losses
    assert_bitwise(none_params, params)
    engine = make_engine(c)
    try:
        kept = sum(c.nbytes for c in reuse.candidates(engine.program, _specs(engine)) if c.key in engine.reuse)
        assert engine.reuse and kept > 0
    finally:
        engine.close()
    for m, n in zip(metrics, none_metrics, strict=True):
        assert n["read_bytes_nvme"] - m["read_bytes_nvme"] == kept


def _specs(engine):
    specs, _ = store_specs(engine.config, engine.program, engine.plan, engine.placement, engine.compute_dtype)
    return specs


def test_the_nearest_reuse_is_the_forward_s_last_iteration():
    engine = make_engine(config(optimizer="host", max_reuse_distance=1))
    try:
        found = reuse.candidates(engine.program, _specs(engine))
        last_scan = [s for s in engine.program.stages if s.kind == "scan"][-1]
    finally:
        engine.close()
    assert found[0].key == (last_scan.position, last_scan.order()[-1]) and found[0].distance == 0
    assert [c.distance for c in found] == sorted(c.distance for c in found)
    assert all(c.nbytes > 0 for c in found)
    assert engine.reuse == frozenset({found[0].key})  # 1 keeps only what is reused at once


def test_a_distance_the_budget_cannot_hold_is_refused_in_one_line():
    """The engine's own planning, on the budget it measured at start, with a limit below what keeping needs."""
    engine = make_engine(config(optimizer="host", recompute="always", max_reuse_distance=0))
    try:
        specs, acts = store_specs(engine.config, engine.program, engine.plan, engine.placement, engine.compute_dtype)
        needs = budget_needs(specs, list(acts.values()), "cpu")
        least = minimum_bytes(engine.budget.baseline, needs[2], needs[0], needs[1])
        every = sum(c.nbytes for c in reuse.candidates(engine.program, specs))
        engine.config = engine.config.replace(max_reuse_distance=10**9, memory_limit=least + every // 2)
        with pytest.raises(MemoryBudgetError, match=r"max_reuse_distance=1000000000 keeps \d+ layers' parameters") as e:
            engine._plan_reuse(specs, needs)
        engine.config = engine.config.replace(memory_limit=least + 4 * every)
        kept, plan = engine._plan_reuse(specs, needs)
    finally:
        engine.close()
    assert "\n" not in str(e.value)
    assert len(kept) == len(reuse.candidates(engine.program, specs)) and plan.limit == least + 4 * every


def test_a_negative_distance_is_refused():
    with pytest.raises(ConfigError, match="max_reuse_distance=-1 must be 0 or more"):
        Config(max_reuse_distance=-1)
