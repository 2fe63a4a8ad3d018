"""The sharding rules: the ZeRO stage table, the persistence threshold, Megatron tensor parallelism."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.engine_helpers import config
from zinfjax import models
from zinfjax.engine import compiled
from zinfjax.engine.stores import plan_stores
from zinfjax.errors import ConfigError
from zinfjax.sections import Tiering
from zinfjax.sharding import ShardingRules, make_mesh, shard_shape
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax.trainers.streaming import lm_program

# ZeRO's stages as docs/sharding.md tables them, written out independently of zinfjax.sharding: what each stage
# shards over `data`.
STAGE_TABLE = {
    0: set(),
    1: {"opt", "master"},
    2: {"opt", "master", "grads"},
    3: {"opt", "master", "grads", "params"},
}


@pytest.mark.parametrize("stage", range(4))
def test_each_stage_shards_the_kinds_of_its_row(stage):
    rules = ShardingRules(stage=stage, data=8)
    for kind in ("params", "grads", "opt", "master"):
        spec = rules.spec(kind, "blocks/fc/kernel", (64, 256))
        assert ("data" in tuple(spec)) == (kind in STAGE_TABLE[stage]), (kind, spec)


def test_small_leaves_stay_replicated_under_the_threshold():
    rules = ShardingRules(stage=3, data=8, threshold=1024)
    assert rules.spec("params", "blocks/ln/scale", (1016,)) == P(None)
    assert rules.spec("params", "blocks/ln/scale", (1024,)) == P("data")
    assert ShardingRules(stage=3, data=8, threshold=0).spec("params", "x", (8,)) == P("data")


def test_leaves_without_a_divisible_dimension_stay_replicated():
    rules = ShardingRules(stage=3, data=8)
    assert rules.spec("params", "embed/wte/embedding", (50257, 1001)) == P(None, None)
    assert rules.spec("params", "embed/wte/embedding", (50257, 768)) == P(None, "data")
    assert rules.spec("params", "blocks/x", (6, 1000, 7)) == P(None, "data", None)


def test_data_takes_the_largest_divisible_dimension_free_of_the_model_axis():
    rules = ShardingRules(stage=3, data=4, model=2, tp=models.gpt.PARTITION_RULES)
    assert rules.spec("params", "blocks/fc/kernel", (64, 256)) == P("data", "model")
    assert rules.spec("params", "blocks/proj/kernel", (256, 64)) == P("model", "data")
    assert rules.spec("params", "blocks/q/kernel", (64, 8, 8)) == P("data", "model", None)
    assert rules.spec("opt", "blocks/0/mu/q/kernel", (64, 8, 8)) == P("data", "model", None)
    assert rules.spec("opt", "blocks/0/count", ()) == P()


def _layout(model_name: str, rules: ShardingRules, mesh):
    """The reference model's program, placement and stage functions under ``rules``."""
    model = models.build(model_name)
    c = config(model=model_name, batch_size=8, seq_len=16, grad_accum=1)
    tx = make_optimizer(c)
    program, _ = lm_program(model, c, tx)
    layout = compiled(program, tx, rules, mesh, jnp.float32)
    return program, layout.placement, layout.stage_fns, layout.plan


def test_the_layer_axis_is_never_sharded():
    mesh = make_mesh({"data": 4, "model": 2})
    rules = ShardingRules.for_mesh(mesh, 3, models.gpt.PARTITION_RULES, threshold=0)
    program, placement, _, plan = _layout("gpt2-tiny", rules, mesh)
    specs = plan_stores(config().section(Tiering), program, plan, placement, jnp.bfloat16, set(program.groups))
    assert {s.kind for s in specs} == {"params", "master", "grads", "opt"}
    for spec in specs:
        for x in jax.tree.leaves(spec.like):
            assert x.sharding.spec[0] is None and len(x.sharding.spec) == x.ndim


def test_a_model_axis_that_does_not_divide_the_heads_is_refused():
    rules = ShardingRules(stage=0, data=1, model=3, tp=models.gpt.PARTITION_RULES)
    with pytest.raises(ConfigError, match=r"blocks/q/kernel.*model axis"):
        rules.spec("params", "blocks/q/kernel", (64, 8, 8))


def _collectives(fn, *args) -> list[str]:
    text = fn.lower(*args).compile().as_text()
    return re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", text)


def _block_inputs(model_name: str, rules: ShardingRules, mesh, store_rules: ShardingRules | None = None):
    """The blocks scan, its functions, and one layer's inputs: parameters as stores hold them at ``store_rules``."""
    program, placement, fns, _ = _layout(model_name, rules, mesh)
    scan = next(s for s in program.scans() if any(program.leaves[k].path.startswith("blocks/") for k in s.streams))
    stored = store_rules or rules
    slices = {k: jax.ShapeDtypeStruct(program.leaves[k].slice_shape, jnp.float32,
                                      sharding=NamedSharding(mesh, stored.spec("params", program.leaves[k].path,
                                                                               program.leaves[k].slice_shape)))
              for k in scan.streams}
    d = models.build(model_name).config.d_model
    h = jax.ShapeDtypeStruct((1, 8, 16, d), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    return program, scan, fns, slices, h


@pytest.mark.parametrize("model_name", ["gpt2-tiny", "llama-tiny"])
def test_tensor_parallel_block_is_megatron_two_all_reduces_and_no_gather(model_name):
    """Column-parallel in, row-parallel out: a block's forward all-reduces after attention and after the MLP."""
    mesh = make_mesh({"data": 2, "model": 4})
    rules = ShardingRules.for_mesh(mesh, 0, models.build(model_name).partition_rules)
    program, scan, fns, slices, h = _block_inputs(model_name, rules, mesh)
    assert _collectives(fns.scan_fwd(scan.position), {}, slices, [], [h], []) == ["all-reduce", "all-reduce"]
    split = [x.sharding.spec for x in slices.values()]
    assert sum("model" in tuple(s) for s in split) >= 5  # every attention and MLP kernel is split


def test_stage3_gathers_params_inside_the_layer_function():
    mesh = make_mesh({"data": 8})
    rules = ShardingRules.for_mesh(mesh, 3)
    program, scan, fns, slices, h = _block_inputs("gpt2-tiny", rules, mesh)
    assert "all-gather" in _collectives(fns.scan_fwd(scan.position), {}, slices, [], [h], [])
    # Stage 2 gathers nothing: its parameters are whole on every device.
    program, scan, fns, slices, h = _block_inputs("gpt2-tiny", ShardingRules.for_mesh(mesh, 2), mesh)
    assert "all-gather" not in _collectives(fns.scan_fwd(scan.position), {}, slices, [], [h], [])


@pytest.mark.parametrize("stage", range(4))
def test_block_gradients_leave_in_the_stage_layout(stage):
    mesh = make_mesh({"data": 8})
    rules = ShardingRules.for_mesh(mesh, stage)
    program, scan, fns, slices, h = _block_inputs("gpt2-tiny", rules, mesh)
    out = fns.scan_bwd(scan.position).lower({}, slices, [], [h], [], [h], []).compile().output_shardings
    grads = out[1]
    sharded = ["data" in tuple(g.spec) for g in jax.tree.leaves(grads)]
    assert any(sharded) == (stage >= 2)
    # Each device keeps 1/8 of every gradient it owns (XLA's CPU backend lowers the reduce-scatter as
    # an all-reduce and a slice; on GPU it is one reduce-scatter).
    if stage >= 2:
        kernel = next(k for k in scan.streams if program.leaves[k].path == "blocks/fc/kernel")
        assert grads[kernel].shard_shape((64, 256)) == (64, 256 // 8)


def test_shard_shape_divides_each_split_dimension():
    assert shard_shape((64, 256), P("data", "model"), {"data": 4, "model": 2}) == (16, 128)
    assert shard_shape((64, 256), P(("data", "model")), {"data": 4, "model": 2}) == (8, 256)
    assert shard_shape((5,), P(), {"data": 4}) == (5,)
    assert np.prod(shard_shape((8, 8), P(None, "data"), {"data": 8})) == 8
