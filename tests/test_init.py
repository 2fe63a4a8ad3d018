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
from tests.engine_helpers import assert_bitwise, config
from zinfjax import models, rss
from zinfjax.engine.budget import MemoryBudgetError
from zinfjax.models.stacked import lm_init
from zinfjax.sharding import make_mesh
from zinfjax.train import lm_engine

NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        assert_bitwise(jax.jit(init_fn)(jax.random.key(c.seed)), wrapped.params)
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
    assert engine.budget.source == "memory_limit" and engine.config.prefetch_depth == 4
    assert engine.config.host_buffer_bytes >= engine.stores.pool.capacity_bytes > 0
    engine.close()
    given = config(nvme_path=str(tmp_path / "b"), memory_limit=limit, prefetch_depth=1, host_buffer_bytes="8MiB",
                   **NVME)
    engine = lm_engine(models.build(given.model), given, make_mesh(given.mesh_axes()))
    assert (engine.config.prefetch_depth, engine.config.host_buffer_bytes) == (1, 8 << 20)
    engine.close()


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
