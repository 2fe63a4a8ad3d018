"""Parameters kept from the forward for the backward (``max_reuse_distance``): exact, fewer reads, budgeted;
unset, only what fits beside the operations in between."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.engine_helpers import assert_bitwise, batches, config, engine_run, engine_specs, make_engine
from zinfjax import Config
from zinfjax.engine import BatchError, reuse
from zinfjax.engine.budget import LIVE_BASE, MemoryBudgetError, minimum_bytes
from zinfjax.engine.engine_plan import EnginePlan, PlanInputs, plan_reuse
from zinfjax.engine.stores import StoreSpec, budget_needs, slice_bytes
from zinfjax.errors import ConfigError
from zinfjax.program import split


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


# ---- the pure cores, on their own: a 2-layer program and hand-made timelines (no engine, no store) ----------------
#
# The program: a whole embedding (4x3), a scan over 2 blocks (3x3 each), a whole head (3x2); fp32, so a block's
# compute copy is 36 bytes (9 parameters), the embedding's 48 (12) and the head's 24 (6).
EMBED, BLOCKS, HEAD = "w:embed", "s:blocks.w", "w:head"


def _layer(h, w):
    return jnp.tanh(h @ w), None


def _lm(p, x):
    h, _ = jax.lax.scan(_layer, x @ p["embed"], p["blocks"]["w"])
    return jnp.sum(h @ p["head"])


def _tied_lm(p, x):
    """The blocks streamed by two scans: the second streams a group the first owns."""
    h, _ = jax.lax.scan(_layer, x @ p["embed"], p["blocks"]["w"])
    h, _ = jax.lax.scan(_layer, h, p["blocks"]["w"])
    return jnp.sum(h @ p["head"])


def _tiled_lm(p, x):
    """A scan over 3 layers whose body scans over 2 tiles: a layer of tiles is never kept whole."""
    def layer(h, w):
        acc, _ = jax.lax.scan(lambda a, wt: (a + jnp.tanh(h @ wt).sum(-1, keepdims=True), None),
                              jnp.zeros_like(h[:, :1]), w)
        return h + acc, None

    h, _ = jax.lax.scan(layer, x, p["w"])
    return jnp.sum(h)


PARAMS = {"embed": jnp.ones((4, 3)), "blocks": {"w": jnp.ones((2, 3, 3))}, "head": jnp.ones((3, 2))}


@functools.cache
def _program(loss=_lm):
    return split(loss, PARAMS, jnp.ones((2, 4)))


def _param_specs(program) -> list:
    """The compute copy's stores as `store_specs` makes them (kind, group, tier, stacked abstract leaves)."""
    return [StoreSpec("params", g.name, "nvme", {leaf.path: jax.ShapeDtypeStruct((g.length, *leaf.slice_shape),
                                                                                  leaf.dtype)
                                                 for leaf in program.leaves_of(g.name)})
            for g in program.groups.values()]


SIZES = {("params", EMBED): 48, ("params", BLOCKS): 36, ("params", HEAD): 24,
         ("master", BLOCKS): 36, ("opt", BLOCKS): 72, ("opt", HEAD): 48}


def test_a_candidates_distance_is_twice_the_parameters_the_forward_reads_after_it():
    """Block 1 is followed by the head's 6 parameters, block 0 by block 1's 9 and the head's 6; the wholes are
    no candidates."""
    found = reuse.candidates(_program(), _param_specs(_program()))
    assert found == [reuse.Candidate((1, 1), 2 * 6, 36), reuse.Candidate((1, 0), 2 * (9 + 6), 36)]


def test_a_tied_scans_iterations_are_candidates_and_a_tiled_layer_is_none():
    program = _program(_tied_lm)
    assert [(c.key, c.distance) for c in reuse.candidates(program, _param_specs(program))] == [
        ((3, 1), 12), ((3, 0), 30), ((1, 1), 48), ((1, 0), 66)]
    program = split(_tiled_lm, {"w": jnp.ones((3, 2, 4, 4))}, jnp.ones((2, 4)))
    assert reuse.candidates(program, _param_specs(program)) == []


def test_choose_keeps_what_is_nearer_than_the_limit_and_nothing_unset():
    found = reuse.candidates(_program(), _param_specs(_program()))
    assert [[c.key for c in reuse.choose(found, limit)] for limit in (None, 0, 12, 13, 31)] == [
        [], [], [], [(1, 1)], [(1, 1), (1, 0)]]


def test_the_timeline_is_the_forward_then_the_backward_reversed_with_the_state_its_updates_read():
    assert reuse.timeline(_program(), SIZES) == [
        (None, 48), ((1, 0), 36), ((1, 1), 36), (None, 24),  # forward: the compute copies
        (None, 24 + 48), ((1, 1), 36 + 36 + 72), ((1, 0), 36 + 36 + 72), (None, 48)]  # backward: and their state


def test_a_scan_that_streams_another_scans_group_reads_no_state_for_it_in_the_backward():
    steps = reuse.timeline(_program(_tied_lm), SIZES)
    backward = steps[len(steps) // 2:]
    assert [r for key, r in backward if key and key[0] == 3] == [36, 36]  # the owner's update reads the state
    assert [r for key, r in backward if key and key[0] == 1] == [144, 144]


def test_a_layer_of_tiles_reads_its_tiles_and_is_never_a_key():
    program = split(_tiled_lm, {"w": jnp.ones((3, 2, 4, 4))}, jnp.ones((2, 4)))
    (group,) = program.groups
    steps = reuse.timeline(program, {("params", group): 64})
    assert [r for _, r in steps if r] == [2 * 64] * 6 and all(key is None for key, _ in steps)


def test_within_keeps_what_fits_beside_every_operation_between_its_two_uses():
    a, b, c = (1, 0), (1, 1), (1, 2)
    steps = [(None, 10), (a, 2), (b, 2), (c, 2), (c, 2), (b, 2), (a, 2)]  # the largest operation reads 10

    def kept(found, eligible=lambda key: True, per_read=1):
        return [x.key for x in reuse.within(found, steps, per_read, eligible)]

    adjacent, middle, outer = reuse.Candidate(c, 0, 100), reuse.Candidate(b, 2, 5), reuse.Candidate(a, 4, 4)
    assert kept([adjacent]) == [c]  # nothing between its uses: kept at any size
    assert kept([middle, outer]) == [b]  # 2 + 5 + 4 > 10 beside (c, c): the second does not fit beside the first
    assert kept([outer]) == [a] and kept([middle, outer], lambda key: key != b) == [a]
    assert kept([reuse.Candidate(b, 2, 8)]) == [b] and kept([reuse.Candidate(b, 2, 9)]) == []  # 2 + 8 == 10 fits
    assert kept([reuse.Candidate(b, 2, 9)], per_read=4) == [b]  # 4 * 2 + 9 <= 4 * 10


def test_handed_over_are_the_first_layers_the_backward_updates_last_within_the_largest_operation():
    """Across the step's end the backward's last operations meet the next forward's first: block 0 is updated
    two operations before its next read and fits beside them; block 1 would sit beside block 0's backward."""
    kept = reuse.handed_over(_program(), SIZES, LIVE_BASE, lambda key: True)
    assert [(c.key, c.distance, c.nbytes) for c in kept] == [((1, 0), 3, 36)]
    asked = []
    assert reuse.handed_over(_program(), SIZES, LIVE_BASE, lambda key: asked.append(key) and False) == []
    assert asked == [(1, 0), (1, 1)]  # every candidate, nearest first
    asked.clear()
    reuse.handed_over(_program(_tied_lm), SIZES, LIVE_BASE, lambda key: asked.append(key) and False)
    assert sorted(asked) == [(1, 0), (1, 1)]  # the scan that streams the blocks without owning them hands none


def test_across_turns_the_step_so_a_backwards_last_update_meets_the_next_forwards_first_read():
    first, second = (1, 0), (1, 1)
    steps = [(first, 1), (second, 1), (second, 1), (first, 1)]  # forward, then the backward reversed
    kept = reuse.across(steps, {first: 5, second: 5}, per_read=1, eligible=lambda key: True)
    # Turned: (second, first | first, second). The first layer's update is the backward's last operation and
    # its read the next forward's first, nothing between them; the second layer's two uses frame them.
    assert [(c.key, c.distance) for c in kept] == [(first, 1)]


def test_held_hands_each_kept_tree_out_once_and_then_lets_go():
    held, trees = reuse.Held(), ["params", "embed"]
    held.keep((3, 0), trees)
    trees.clear()  # the caller's list is not what is held
    slots = [held.slot((3, 0), k) for k in range(2)]
    assert [s.part_nbytes() for s in slots] == [0, 0] and slots[0].tier is None  # the read-ahead counts no bytes
    assert slots[1].read(0).result() == "embed" and held.has((3, 0))
    assert slots[0].read(0, keys=("w",), memory_kind="pinned_host").result() == "params"
    assert not held.has((3, 0))
    with pytest.raises(KeyError):
        held.take((3, 0), 0)
