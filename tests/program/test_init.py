"""Initialisation one layer at a time, straight into the tiers: bitwise the model's own ``init``, at each entry."""

import json
import os
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zinfjax
from tests.support.engine_helpers import assert_bitwise, config
from zinfjax import models
from zinfjax.engine.budget import MAX_DEPTH, MemoryBudgetError
from zinfjax.models.stacked import lm_init
from zinfjax.runtime import rss
from zinfjax.sections import Memory
from zinfjax.sharding import make_mesh
from zinfjax.trainers.streaming import lm_engine

NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_layerwise_init_into_nvme_is_bitwise_the_in_memory_init(tmp_path, model):
    c = config(model=model, mesh="data:2", stage=3, nvme_path=str(tmp_path), **NVME)
    built = models.build(model)
    engine = lm_engine(built, c, make_mesh(c.mesh_axes()))
    try:
        assert_bitwise(jax.jit(lm_init(built))(jax.random.key(c.seed)), engine.params())
        assert engine.stores.params["s:blocks"].tier == "nvme"
    finally:
        engine.close()


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(h)))), None


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)
        h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=6)()(h, None)
        return nn.Dense(3)(h).mean(axis=1)


def test_wrap_with_abstract_params_and_init_fn_never_materialises_the_tree(tmp_path):
    """A Flax user's model that does not fit: eval_shape params + init_fn, initialised layer by layer."""
    model = Encoder()
    example = jnp.zeros((1, 5, 4))
    init_fn = lambda rng: model.init(rng, example)["params"]  # noqa: E731
    abstract = jax.eval_shape(init_fn, jax.random.key(0))
    state = train_state.TrainState.create(apply_fn=model.apply, params=abstract, tx=optax.adam(1e-3))

    def loss_fn(params, batch):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    batch = {"x": np.ones((4, 5, 4), np.float32), "y": np.zeros((4, 3), np.float32)}
    c = config(mesh="data:1", nvme_path=str(tmp_path), **NVME)
    with zinfjax.wrap(state, c, loss_fn=loss_fn, init_fn=init_fn, batch=batch) as wrapped:
        assert_bitwise(jax.jit(init_fn)(jax.random.key(c.seed)), wrapped.read_params())
        wrapped.train_step(batch)
    with pytest.raises(zinfjax.WrapError, match="init_fn"):
        zinfjax.wrap(state, c, loss_fn=loss_fn)


def test_a_budget_below_the_minimum_is_refused_before_anything_is_written(tmp_path):
    c = config(nvme_path=str(tmp_path / "nv"), memory_limit="100MiB", **NVME)
    with pytest.raises(MemoryBudgetError, match=r"memory budget of 100\.0 MiB.*smallest budget that would work is "
                                                 r"\d+(\.\d+)? [MG]iB"):
        lm_engine(models.build(c.model), c, make_mesh(c.mesh_axes()))
    assert not (tmp_path / "nv").exists()


def test_the_budget_sets_buffers_and_read_ahead_unless_given(tmp_path):
    limit = rss.current_bytes() + (2 << 30)  # a budget above what this test process already holds
    auto = config(nvme_path=str(tmp_path / "a"), memory_limit=limit, **NVME)
    engine = lm_engine(models.build(auto.model), auto, make_mesh(auto.mesh_axes()))
    assert engine.budget.source == "memory_limit" and engine.budget.prefetch_depth == MAX_DEPTH
    assert engine.budget.host_buffer_bytes >= engine.stores.pool.capacity_bytes > 0
    assert engine.settings.memory == auto.section(Memory)  # what the budget derived is its own, not the settings
    engine.close()
    given = config(nvme_path=str(tmp_path / "b"), memory_limit=limit, prefetch_depth=1, host_buffer_bytes="8MiB",
                   **NVME)
    engine = lm_engine(models.build(given.model), given, make_mesh(given.mesh_axes()))
    assert (engine.budget.prefetch_depth, engine.budget.host_buffer_bytes) == (1, 8 << 20)
    engine.close()


@pytest.mark.slow
def test_sigkill_during_initialisation_leaves_nothing_a_resume_mistakes_for_a_state(tmp_path):
    sets = ["model=gpt2-mini", "steps=2", "batch_size=2", "seq_len=16", f"save_dir={tmp_path / 'ckpt'}",
            f"nvme_path={tmp_path / 'nv'}", "params=nvme", "optimizer=nvme", "mesh=data:1"]
    argv = [sys.executable, "-m", "zinfjax.cli", "train", "--quiet", *[a for s in sets for a in ("--set", s)]]
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (tmp_path / "nv" / "params_blocks").exists() and time.time() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err.decode()
    out = subprocess.run(argv + ["--set", "resume=true", "--set", f"log={tmp_path / 'log.json'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no checkpoint" in out.stderr and "starting from step 0" in out.stderr
    assert [s["step"] for s in json.loads((tmp_path / "log.json").read_text())["steps"]] == [1, 2]


@pytest.mark.parametrize("name,init", [
    ("normal", lambda k: jax.random.normal(k, (1000, 8)) * 0.02),
    ("flax Embed", lambda k: nn.Embed(1000, 8).init(k, jnp.zeros((1,), jnp.int32))["params"]["embedding"]),
    ("truncated normal", lambda k: jax.nn.initializers.truncated_normal(0.02)(k, (1000, 8))),
    ("uniform", lambda k: jax.random.uniform(k, (1000, 8), minval=-1, maxval=1)),
    ("bf16 normal", lambda k: jax.random.normal(k, (1000, 8), jnp.bfloat16)),
])
def test_row_chunks_of_a_table_are_bitwise_its_rows_without_the_whole(name, init):
    """Row chunks (the last one past the end, zero-padded) equal the whole table's rows, bit for bit."""
    from zinfjax.program import jaxpr as jx
    from zinfjax.program.rows import row_chunk

    key = jax.random.key(3)
    closed, _ = jx.trace(init, jax.ShapeDtypeStruct((), key.dtype))
    whole = np.asarray(jax.jit(init)(key))
    chunk = jax.jit(lambda k, lo: row_chunk(closed, closed.jaxpr.outvars[0], k, lo, 300))
    for lo in (0, 300, 900):
        want = np.zeros((300, 8), whole.dtype)
        want[: min(300, 1000 - lo)] = whole[lo : lo + 300]
        np.testing.assert_array_equal(np.asarray(chunk(key, lo)), want)


def test_a_table_from_non_row_wise_code_is_refused_by_row_chunk():
    from zinfjax.program import jaxpr as jx
    from zinfjax.program.rows import Unsliceable, row_chunk

    key = jax.random.key(0)
    closed, _ = jx.trace(lambda k: jax.random.normal(k, (8, 1000)).T, jax.ShapeDtypeStruct((), key.dtype))
    with pytest.raises(Unsliceable, match="transpose"):
        row_chunk(closed, closed.jaxpr.outvars[0], key, 0, 300)


def test_the_embedding_initialises_chunk_by_chunk():
    """GPT-2's table never exists whole at initialisation: its source computes each chunk alone."""
    from zinfjax.program.init import InitSource
    from zinfjax.trainers.optimizers import make_optimizer
    from zinfjax.trainers.streaming import lm_program

    built, c = models.build("gpt2-tiny"), config(mesh="data:1")
    program, _ = lm_program(built, c, make_optimizer(c))
    source = InitSource(program, lm_init(built), jax.random.key(0))
    (wte,) = [leaf for leaf in program.leaves if leaf.path.endswith("wte/embedding")]
    assert wte.stream.rows and source._chunk_fn(wte.index) is not None


def test_a_budget_just_above_the_minimum_is_lean_and_one_above_it_reads_ahead():
    """The budget's three regimes, from its own arithmetic (gpt2-small-sized slices)."""
    from zinfjax.engine.budget import LIVE_PER_DEPTH, make_budget, minimum_bytes

    read, write, base = 84 << 20, 56 << 20, 300 << 20
    least = minimum_bytes(base, 0, read, write)
    lean = make_budget(Memory(memory_limit=least + (10 << 20)), read, write, baseline=base)
    assert lean.lean and lean.prefetch_depth == 1 and lean.host_buffer_bytes == lean.write_bytes_in_flight == write
    roomy = make_budget(Memory(memory_limit=least + 2 * write + 2 * LIVE_PER_DEPTH * read), read, write, baseline=base)
    assert not roomy.lean and roomy.prefetch_depth == 3 and roomy.write_bytes_in_flight == 2 * write
    with pytest.raises(MemoryBudgetError, match=r"smallest budget that would work is 940\.0 MiB"):
        make_budget(Memory(memory_limit=least - 1), read, write, baseline=base)
