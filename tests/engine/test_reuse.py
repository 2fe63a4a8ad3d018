"""Parameters kept from the forward for the backward (``max_reuse_distance``): exact, fewer reads, budgeted;
unset, only what fits beside the operations in between."""

import jax
import numpy as np
import pytest

from tests.support.engine_helpers import assert_bitwise, batches, config, engine_run, engine_specs, make_engine
from zinfjax import Config
from zinfjax.engine import BatchError, reuse
from zinfjax.engine.budget import LIVE_BASE, MemoryBudgetError, minimum_bytes
from zinfjax.engine.engine_plan import EnginePlan, PlanInputs, plan_reuse
from zinfjax.engine.stores import budget_needs, slice_bytes
from zinfjax.errors import ConfigError


def test_reuse_reads_less_and_is_bitwise_the_run_without(tmp_path):
    c = config(stage=3, params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "nvme"), max_reuse_distance=10**9)
    losses, params, metrics = engine_run(c, steps=5)
    none_losses, none_params, none_metrics = engine_run(c.replace(max_reuse_distance=0), steps=5)
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
    specs, _ = engine_specs(engine)
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
        specs, acts = engine_specs(engine)
        needs = budget_needs(specs, list(acts.values()), "cpu")
        least = minimum_bytes(engine.budget.baseline, needs[2], needs[0], needs[1])
        every = sum(c.nbytes for c in reuse.candidates(engine.program, specs))
        memory = EnginePlan(engine.parts, engine.budget, needs, engine.saves_residuals)

        def inputs(**changes) -> PlanInputs:
            return PlanInputs(engine.settings.memory.replace(**changes), engine.program, engine.update_plan, specs,
                              list(acts.values()), "cpu", engine.residual_bytes, engine.spools_gradients,
                              engine.on_host)

        with pytest.raises(MemoryBudgetError, match=r"max_reuse_distance=1000000000 keeps \d+ layers' parameters") as e:
            plan_reuse(inputs(max_reuse_distance=10**9, memory_limit=least + every // 2), memory)
        planned = plan_reuse(inputs(max_reuse_distance=10**9, memory_limit=least + 4 * every), memory)
    finally:
        engine.close()
    assert "\n" not in str(e.value)
    assert len(planned.reuse) == len(reuse.candidates(engine.program, specs))
    assert planned.budget.limit == least + 4 * every


def test_a_negative_distance_is_refused():
    with pytest.raises(ConfigError, match="max_reuse_distance=-1 must be 0 or more"):
        Config(max_reuse_distance=-1)


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.wide), "bf16"])
def test_unset_keeps_the_head_and_hands_the_first_layers_over_bitwise_the_run_that_keeps_none(tmp_path, precision):
    """gpt2-tiny's program is gpt2-small's: embedding chunks, wpe, blocks, ln_f, the tied head's chunks, loss."""
    c = config(stage=3, precision=precision, params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "nvme"))
    assert c.max_reuse_distance is None
    losses, params, metrics = engine_run(c, steps=5)
    off_losses, off_params, off_metrics = engine_run(c.replace(max_reuse_distance=0), steps=5)
    assert losses == off_losses
    assert_bitwise(off_params, params)
    engine = make_engine(c)
    try:
        specs, program = _specs(engine), engine.program
        found = {x.key: x for x in reuse.candidates(program, specs)}
        kept, handoff = sorted(engine.reuse), engine.handoff
        sizes = {(s.kind, s.group): slice_bytes(s) for s in specs}
    finally:
        engine.close()
    embedding, blocks, head = [s for s in program.stages if s.kind == "scan"]
    # The head's chunks are read for its forward and at once again for its backward: all kept. So is the
    # last block in fp32, whose two uses frame only the head (in bf16 its backward casts the master its
    # update reads anyway); the block before it would sit beside the last block's backward, the step's
    # largest operation.
    last = {(blocks.position, blocks.order()[-1])} if precision == "fp32" else set()
    assert {(head.position, i) for i in head.order()} | last == set(kept)
    # The backward updates the embedding's chunks and then the first block last; the next forward reads
    # them first: their new compute copies go straight to it. The second block's would sit beside the
    # first's backward.
    group = {s: next(iter({program.leaves[k].group for k in s.streams})) for s in (embedding, blocks)}
    assert {(group[embedding], i) for i in embedding.order()} | {(group[blocks], 0)} == handoff
    handed = sum(sizes[("params", g)] for g, _ in handoff)
    for n, (m, off) in enumerate(zip(metrics, off_metrics, strict=True)):
        assert off["read_bytes_nvme"] - m["read_bytes_nvme"] == sum(found[k].nbytes for k in kept) + (
            handed if n else 0)  # the first step has nothing handed over yet
    # What is kept never sits beside more than the largest operation takes (LIVE_BASE of its reads).
    steps = reuse.timeline(program, sizes)
    largest = LIVE_BASE * max(r for _, r in steps)
    spans = [[n for n, (key, _) in enumerate(steps) if key == k] for k in kept]
    for n, (_, r) in enumerate(steps):
        held = sum(found[k].nbytes for k, (a, b) in zip(kept, spans, strict=True) if a < n < b)
        assert LIVE_BASE * r + held <= largest


@pytest.mark.parametrize("kw", [dict(params="host"), dict(params="nvme", precision="bf16")])
def test_unset_keeps_nothing_whose_backward_reads_nothing_again(tmp_path, kw):
    """On the CPU, a host-tier read copies nothing; in bf16 a block's backward casts its compute copy from the
    master its update reads anyway (the head's chunks, updated by the embedding, are still read twice)."""
    engine = make_engine(config(stage=3, optimizer="nvme", nvme_path=str(tmp_path / "nvme"), **kw))
    try:
        program, kept = engine.program, engine.reuse
    finally:
        engine.close()
    owned = {k for k in kept if any(program.groups[program.leaves[leaf].group].position == k[0]
                                    for s in program.stages if s.position == k[0] for leaf in s.streams)}
    assert not owned
    head = [s for s in program.stages if s.kind == "scan"][-1]
    assert kept == (frozenset() if kw["params"] == "host" else {(head.position, i) for i in head.order()})


def test_a_failed_step_drops_what_it_handed_over_and_the_next_reads_it_bitwise(tmp_path):
    c = config(stage=3, params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "nvme"))
    off_losses, off_params, _ = engine_run(c.replace(max_reuse_distance=0), steps=4)
    engine = make_engine(c)
    try:
        data, losses, reads = batches(c), [], []
        for n in range(4):
            if n == 2:
                bad = next(batches(c))[:, :-1]  # a token short
                with pytest.raises(BatchError, match="this state was wrapped for"):
                    engine.train_step(bad)
                assert not any(engine.handed_over.has(key) for key in engine.handoff)
            m = engine.train_step(next(data))
            losses.append(m["loss"])
            reads.append(m["read_bytes_nvme"])
        params = jax.tree.map(np.asarray, engine.params())
    finally:
        engine.close()
    assert losses == off_losses
    assert_bitwise(off_params, params)
    assert engine.handoff and reads[2] > reads[1] == reads[3]  # after the failure, the handed-over layers read again
