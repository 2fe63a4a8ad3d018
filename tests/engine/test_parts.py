"""Update parts: a layer updated a few leaves at a time reads less, and gives the same numbers bit for bit.

`zinfjax.engine.parts` cuts the update of a streamed layer into parts when the optimizer updates
each leaf from its own state (`UpdatePlan.separable`); stores read and write those leaves alone
(``read(i, keys)``, ``write(i, part, keys)``). The engine with parts is held to the engine with one
fused update per layer (the same per-leaf computation, compiled per part) and to the in-memory
reference, as every engine path is (tests/engine/test_exact.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.support.engine_helpers import config, engine_run, engine_specs, exact_run, make_engine, reference_run
from tests.support.tolerances import assert_no_farther, assert_run_no_farther, loss_distance
from zinfjax import Config, models
from zinfjax._util.deepspeed_config import from_deepspeed
from zinfjax.engine.budget import minimum_bytes
from zinfjax.engine.parts import update_parts
from zinfjax.engine.stores import budget_needs, leaf_slice_bytes
from zinfjax.errors import ConfigError
from zinfjax.models import ModelConfig
from zinfjax.runtime import rss
from zinfjax.sharding import make_mesh
from zinfjax.store import BufferPool, StoreError, open_store
from zinfjax.trainers.streaming import lm_engine

L = 3


def _like():
    return {"a": jax.ShapeDtypeStruct((L, 64, 32), jnp.float32), "b": jax.ShapeDtypeStruct((L, 32), jnp.bfloat16),
            "c": jax.ShapeDtypeStruct((L, 16), jnp.int32)}


def _layer(i):
    rng = np.random.default_rng(i)
    return {"a": rng.standard_normal((64, 32)).astype(np.float32),
            "b": rng.standard_normal(32).astype(jnp.bfloat16), "c": rng.integers(0, 99, 16).astype(np.int32)}


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_a_part_of_a_layer_reads_and_writes_alone(tmp_path, tier):
    store = open_store(tier, _like(), path=str(tmp_path), pool=BufferPool(8 << 20))
    try:
        for i in range(L):
            store.write(i, _layer(i))
        new_a = np.full((64, 32), 7.0, np.float32)
        store.write(1, {"a": new_a}, keys=["a"])
        part = store.read(1, keys=("c", "a")).result()
        assert sorted(part) == ["a", "c"]
        np.testing.assert_array_equal(np.asarray(part["a"]), new_a)
        whole = store.read(1).result()  # the part replaced "a" and left "b" and "c" as they were
        np.testing.assert_array_equal(np.asarray(whole["a"]), new_a)
        np.testing.assert_array_equal(np.asarray(whole["b"]).view(np.uint16), _layer(1)["b"].view(np.uint16))
        np.testing.assert_array_equal(np.asarray(whole["c"]), _layer(1)["c"])
        assert store.part_nbytes(["a", "c"]) == 64 * 32 * 4 + 16 * 4
    finally:
        store.close()


def test_a_part_that_names_no_leaf_or_the_wrong_leaves_is_refused(tmp_path):
    store = open_store("nvme", _like(), path=str(tmp_path), pool=BufferPool(8 << 20))
    try:
        store.write(0, _layer(0))
        with pytest.raises(StoreError, match=r"keys \['z'\] name no leaf of this store"):
            store.read(0, keys=["z"])
        with pytest.raises(StoreError, match=r"a part written as keys \['a'\] holds \['b'\]"):
            store.write(0, {"b": _layer(0)["b"]}, keys=["a"])
        np.testing.assert_array_equal(np.asarray(store.read(0).result()["a"]), _layer(0)["a"])  # nothing lost
    finally:
        store.close()


def test_nested_trees_move_whole_layers_only(tmp_path):
    like = {"x": {"w": jax.ShapeDtypeStruct((L, 8), jnp.float32)}}
    store = open_store("host", like, path=str(tmp_path))
    with pytest.raises(StoreError, match="only a store whose tree is a flat dict moves part of a layer"):
        store.read(0, keys=["x"])


def _cut(c, tx=None):
    """What the engine of ``c`` would work with: its specs, program and plan, and the parts of its layers."""
    engine = make_engine(c, tx=tx)
    try:
        specs, _ = engine_specs(engine)
        return specs, engine.program, engine.update_plan, update_parts(engine.program, engine.update_plan, specs, False,
                                                                c.sub_group_size)
    finally:
        engine.close()


def test_a_part_reads_no_more_than_the_backward_or_the_largest_leaf(tmp_path):
    specs, program, plan, parts = _cut(config(precision="bf16", params="nvme", optimizer="nvme",
                                              nvme_path=str(tmp_path)))
    assert list(parts) == ["s:blocks"], parts
    cut = parts["s:blocks"]
    assert len(cut) > 1
    assert [k for p in cut for k in p.leaves] == list(program.groups["s:blocks"].leaves)  # each leaf once, in order
    by_kind = {s.kind: s for s in specs if s.group == "s:blocks"}

    def reads(p):
        return sum(leaf_slice_bytes(by_kind[kind], key) for kind in ("master", "opt") for key in p.keys(kind))

    largest_leaf = max(reads(p) for p in update_parts(program, plan, specs, False, sub_group_size=1)["s:blocks"])
    limit = max(sum(leaf_slice_bytes(by_kind["params"], p) for p in by_kind["params"].like), largest_leaf)
    assert all(reads(p) <= limit for p in cut), [(p.params, reads(p)) for p in cut]
    acts = []
    whole, in_parts = budget_needs(specs, acts, "cpu"), budget_needs(specs, acts, "cpu", parts)
    assert in_parts[0] < whole[0] / 2 and in_parts[1] < whole[1], (in_parts, whole)  # reads, and a write staged


def test_sub_group_size_packs_parameters_and_the_deepspeed_key_sets_it():
    _, program, _, parts = _cut(config(precision="bf16", sub_group_size=1))
    assert [p.leaves for p in parts["s:blocks"]] == [(k,) for k in program.groups["s:blocks"].leaves]
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, "sub_group_size": 1e9}}
    assert from_deepspeed(ds)["sub_group_size"] == 10**9
    with pytest.raises(ConfigError, match="sub_group_size=0 must be positive"):
        Config(sub_group_size=0)


@pytest.mark.parametrize("tx,cut", [(optax.adamw(1e-3), True), (optax.sgd(1e-2, momentum=0.9), True),
                                    (optax.lamb(1e-3), False),
                                    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), False)])
def test_only_optimizers_that_update_each_leaf_alone_are_cut(tx, cut):
    _, _, plan, parts = _cut(config(precision="bf16"), tx=tx)  # the master and state: more than the backward reads
    assert plan.separable("s:blocks") is cut
    assert bool(parts) is cut


def _wide(tmp_path, **kw):
    """An engine on a model whose layers are large enough (3.1M parameters) for the budget's regimes to differ."""
    c = config(mesh="data:1", params="nvme", optimizer="nvme", activations="nvme", nvme_path=str(tmp_path), **kw)
    model = models.build(ModelConfig.named("gpt2-tiny").replace(n_layers=2, d_model=512, d_ff=2048))
    return lm_engine(model, c, make_mesh(c.mesh_axes()))


def test_layers_are_cut_only_when_the_budget_needs_it(tmp_path):
    engine = _wide(tmp_path / "roomy", memory_limit=rss.current_bytes() + (4 << 30))
    specs, acts = engine_specs(engine)
    assert engine.parts == {} and not engine.budget.lean  # room to spare: one update per layer, fewer operations
    engine.close()
    read, write, _ = budget_needs(specs, list(acts.values()), "cpu")
    # Between the minimum and a roomy budget for whole layers (about 130 MB wide here): lean for whole layers.
    limit = rss.current_bytes() + minimum_bytes(0, 0, read, write) + write
    engine = _wide(tmp_path / "tight", memory_limit=limit)
    try:
        assert engine.parts, engine.budget
        assert engine.budget.prefetch_depth >= 1
    finally:
        engine.close()


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.numeric),
                                       pytest.param("bf16", marks=[pytest.mark.low_precision, pytest.mark.wide])])
def test_parts_equal_one_update_per_layer(tmp_path, precision):
    """Each leaf's update is the same computation whole or in parts, but XLA compiles a part's function on its own,
    so the master may differ in the last bit of fp32: the parts are no farther from the in-memory loop run in
    float64 than the whole update is. In bf16 such a bit can flip a compute copy's rounding, and five steps
    compound it: no farther from fp32 than the whole update is (the tolerances' rule)."""
    c = config(precision=precision, params="nvme", optimizer="nvme", gradients="nvme", activations="nvme",
               nvme_path=str(tmp_path / "parts"), sub_group_size=1)  # every leaf a part
    losses, params, _ = engine_run(c, steps=5)
    whole = c.replace(nvme_path=str(tmp_path / "whole"), sub_group_size=None)
    whole_losses, whole_params, _ = engine_run(whole, steps=5)
    if precision == "fp32":  # the float64 loop depends on the numerics alone: config()'s, shared with test_exact.py
        assert_run_no_farther(exact_run(config(), 5), (whole_losses, whole_params), (losses, params))
        return
    exact_losses, exact_params, _ = engine_run(whole.replace(precision="fp32", nvme_path=str(tmp_path / "fp32")),
                                               steps=5)
    assert_no_farther(exact_params, whole_params, params)
    assert_no_farther(exact_losses, whole_losses, losses, loss_distance)


# make test holds parts to the reference over 5 steps (and to the whole update above); the
# wide form, for make test-all, over the 20 steps of the other reference comparisons.
@pytest.mark.numeric
@pytest.mark.parametrize("steps", [5, pytest.param(20, marks=pytest.mark.wide)])
def test_parts_equal_the_in_memory_reference(tmp_path, steps):
    c = config(params="nvme", optimizer="nvme", activations="nvme", nvme_path=str(tmp_path), sub_group_size=5000)
    losses, params, _ = engine_run(c, steps)
    assert_run_no_farther(exact_run(config(), steps), reference_run(c, steps), (losses, params))
