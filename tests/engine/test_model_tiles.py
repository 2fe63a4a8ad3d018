"""The reference models in tiles (`zinfjax.models.tiling`): the same parameters, streamed one tile at a time.

- **A view.** ``ModelConfig.tiles`` changes how a block computes, not what it holds: ``model.init``
  gives the same tree for every tile count, bit for bit, and the engine initialises each tile alone
  (`zinfjax.program.blocks`) with the values of the whole.
- **Exact.** Tiling reorders the MLP's and attention's sums (fp32, tile after tile), nothing else: the
  tiled engine on NVMe is no farther from the untiled in-memory loop run in float64 than the fp32 loop is,
  on losses and parameters (whole-tree relative L2, less GPT-2's key bias, whose true gradient is zero:
  `ZERO_GRADIENT_LEAVES`; tests/support/tolerances.py). For one tile count, the tiers agree bit for bit.
- **bf16.** Rounding compounds with no useful a-priori bound, so the tiled bf16 run is held to be no
  farther from the fp32 run than the untiled bf16 run is (`assert_no_farther`, docs/engine.md).
- **auto.** ``tiles=auto`` runs untiled when the model fits and otherwise picks the fewest tiles whose
  largest operation fits the memory budget: half as many do not.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.support.engine_helpers import (
    _tx,
    assert_bitwise,
    batches,
    config,
    exact_run,
    initial_params,
    reference_run,
    relative_error,
)
from tests.support.tolerances import LOSS_SLACK, SLACK, assert_no_farther, assert_run_no_farther, loss_distance
from zinfjax import models
from zinfjax.engine import TreeSource
from zinfjax.engine.budget import MemoryBudgetError
from zinfjax.errors import ConfigError
from zinfjax.models.configs import ModelConfig
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.program import InitSource, program_for
from zinfjax.program.split import store_slice
from zinfjax.runtime import rss
from zinfjax.sharding import make_mesh
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax.trainers.streaming import choose_tiles, fits, lm_engine, lm_program

STEPS = 20
NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")
LARGE = ModelConfig("gpt2", 256, 64, 4096, 2, 32, 65536)  # one block of 2.4 GB of fp32 weights


def tiled_run(c, tiles: int, steps: int = STEPS, stream_tiles: str = "always"):
    """The engine on ``c`` with the model in ``tiles`` tiles, from the reference's initial parameters; streamed
    tile by tile unless ``stream_tiles`` says otherwise."""
    c = c.replace(stream_tiles=stream_tiles)
    model = models.build(ModelConfig.resolve(c.model).replace(tiles=tiles), _dtype(c))
    params = initial_params(c)
    engine = lm_engine(model, c, make_mesh(c.mesh_axes()), source=lambda p, plan: TreeSource(p, plan, params),
                       tx=_tx(c))
    try:
        data = batches(c)
        losses = [engine.train_step(next(data))["loss"] for _ in range(steps)]
        groups = {g.name: g.length for g in engine.program.streamed_groups()}
        return losses, jax.tree.map(np.asarray, engine.params()), groups
    finally:
        engine.close()


def _dtype(c):
    from zinfjax._util.choices import COMPUTE_DTYPES

    return COMPUTE_DTYPES[c.precision]


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["gpt2-tiny", pytest.param("llama-tiny", marks=pytest.mark.wide)])
def test_tiles_are_a_view_of_the_same_parameters_initialised_a_tile_at_a_time(name):
    base = ModelConfig.named(name)
    whole = jax.jit(lm_init(models.build(base)))(jax.random.key(5))
    for tiles in (2, 8):
        model = models.build(base.replace(tiles=tiles))
        assert_bitwise(jax.jit(lm_init(model))(jax.random.key(5)), whole)
        like = jax.eval_shape(lm_init(model), jax.random.key(0))
        program = program_for(lm_loss(model), like, jax.ShapeDtypeStruct((2, 17), np.int32))
        source, flat = InitSource(program, lm_init(model), jax.random.key(5)), jax.tree.leaves(whole)
        tiled = [g for g in program.streamed_groups() if ".tiles" in g.name]
        assert tiled and all(g.length == base.n_layers * tiles for g in tiled)
        for g in program.groups.values():
            for i in range(g.length):
                for leaf, x in zip(program.leaves_of(g.name), source.params(g.name, i), strict=True):
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(store_slice(leaf, flat[leaf.index], i)))
        assert all(fn is not None for fn in vars(source)["_instance_cache__tile_fn"].values())  # none made whole


# make test: GPT-2 in 4 tiles and Llama (grouped-query attention) in 8; tiles at stage 3 are in make test through
# tests/engine/test_tiles.py, and every count at both stages here in the wide form.
CASES = [("gpt2-tiny", 4, {}), pytest.param("llama-tiny", 8, {}, marks=pytest.mark.wide)]
WIDE = [(name, t, s) for name in ("gpt2-tiny", "llama-tiny") for t in (1, 2, 4, 8) for s in ({}, dict(stage=3))]


def _exact(name, tiles, extra, tmp_path, steps=STEPS):
    c = config(model=name, **NVME, nvme_path=str(tmp_path), **extra)
    ref_losses, ref_params = reference_run(c, steps)
    losses, params, groups = tiled_run(c, tiles, steps)
    if tiles > 1:
        assert max(groups.values()) == ModelConfig.named(name).n_layers * tiles
    # The float64 loop depends on the model and the numerics alone, not the tiers or the stage: one per model.
    assert_run_no_farther(exact_run(config(model=name), steps), (ref_losses, ref_params), (losses, params))


@pytest.mark.numeric
@pytest.mark.parametrize(("name", "tiles", "extra"), CASES)
def test_tiled_engine_on_nvme_is_the_untiled_in_memory_loop(name, tiles, extra, tmp_path):
    """The short form: 5 steps (the wide form runs every case for 20)."""
    _exact(name, tiles, extra, tmp_path, steps=5)


@pytest.mark.numeric
@pytest.mark.wide
@pytest.mark.parametrize(("name", "tiles", "extra"), WIDE)
def test_tiled_engine_is_the_untiled_loop_wide(name, tiles, extra, tmp_path):
    _exact(name, tiles, extra, tmp_path)


def test_one_tile_count_is_bitwise_across_tiers(tmp_path):
    device_losses, device_params, _ = tiled_run(config(), 4, steps=5)
    nvme_losses, nvme_params, _ = tiled_run(config(**NVME, nvme_path=str(tmp_path)), 4, steps=5)
    assert nvme_losses == device_losses
    assert_bitwise(nvme_params, device_params)


@pytest.mark.low_precision
@pytest.mark.wide
def test_tiled_bf16_is_no_farther_from_fp32_than_untiled_bf16(tmp_path):
    def run(precision, tiles):
        c = config(precision=precision, **NVME, nvme_path=str(tmp_path / f"{precision}-{tiles}"))
        return tiled_run(c, tiles, steps=6)[:2]

    exact_losses, exact = run("fp32", 1)
    ref_losses, ref = run("bf16", 1)
    losses, ours = run("bf16", 4)
    assert_no_farther(exact, ref, ours, distance=relative_error, slack=SLACK)
    assert_no_farther(exact_losses, ref_losses, losses, distance=loss_distance, slack=LOSS_SLACK)


def test_a_tile_count_that_does_not_divide_is_one_line_naming_the_divisors():
    with pytest.raises(ConfigError, match=r"tiles=3 does not divide d_ff=256, n_heads=8.*: 1, 2, 4, 8$"):
        ModelConfig.named("gpt2-tiny").replace(tiles=3)
    with pytest.raises(ConfigError, match="BERT's blocks are not tiled"):
        ModelConfig("bert", 256, 64, 64, 2, 8, 256, tiles=2)


def test_auto_runs_untiled_where_the_model_fits_and_else_the_fewest_tiles_that_fit(tmp_path):
    mesh = make_mesh({"data": 1})
    roomy = config(model="gpt2-small", mesh="data:1", **NVME, nvme_path=str(tmp_path), memory_limit=16 << 30)
    assert choose_tiles(ModelConfig.named("gpt2-small"), roomy, mesh).tiles == 1
    path = tmp_path / "large.yaml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in LARGE.__dict__.items()))
    # The budget counts what the process holds already (this test process's, not a fresh one's): 1.4 GiB beside it.
    tight = config(model=str(path), mesh="data:1", batch_size=1, seq_len=64, **NVME, nvme_path=str(tmp_path),
                   memory_limit=rss.current_bytes() + (1400 << 20))
    chosen = choose_tiles(LARGE, tight, mesh).tiles
    assert chosen > 1
    with pytest.raises(MemoryBudgetError):  # half as many tiles do not fit: the fewest that do
        fits(LARGE.replace(tiles=chosen // 2), tight, mesh)
    # A layer that does not fit whole is streamed tile by tile (stream_tiles=auto).
    program, _ = lm_program(models.build(LARGE.replace(tiles=chosen)), tight, make_optimizer(tight), mesh)
    assert {g.length for g in program.streamed_groups() if ".tiles" in g.name} == {LARGE.n_layers * chosen}


@pytest.mark.numeric
def test_auto_streams_a_tiled_layer_whole_where_it_fits(tmp_path):
    """``stream_tiles=auto``: gpt2-tiny in 4 tiles, whose layers fit the budget, is read, written and updated a
    whole layer an operation (no tile group), its tiles computed in turn inside it; and it is the in-memory loop."""
    c = config(model="gpt2-tiny", **NVME, nvme_path=str(tmp_path))
    ref_losses, ref_params = reference_run(c, 5)
    losses, params, groups = tiled_run(c, 4, steps=5, stream_tiles="auto")
    assert groups["s:blocks"] == ModelConfig.named("gpt2-tiny").n_layers
    assert not [g for g in groups if ".tiles" in g or ".layer" in g], groups
    assert_run_no_farther(exact_run(config(model="gpt2-tiny"), 5), (ref_losses, ref_params), (losses, params))
