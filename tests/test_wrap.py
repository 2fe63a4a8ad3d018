"""zinfjax.wrap on a Flax Linen TrainState and an NNX Optimizer."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zinfjax
from tests.support.engine_helpers import batches, config, exact_run, initial_params, reference_run
from tests.support.tolerances import assert_loss_no_farther
from zinfjax import models


@pytest.mark.numeric
def test_wrapping_a_linen_train_state_trains_like_the_reference(tmp_path):
    c = config(params="nvme", optimizer="host", nvme_path=str(tmp_path))
    model = models.build(c.model)
    state = train_state.TrainState.create(apply_fn=model.apply, params=initial_params(c), tx=optax.adamw(c.lr))
    ref_losses, _ = reference_run(c, steps=3)
    data, losses = batches(c), []
    with zinfjax.wrap(state, c) as state:
        for _ in range(3):
            state, metrics = state.train_step(next(data))
            losses.append(metrics["loss"])
        assert state.step == 3 and metrics["read_bytes_nvme"] > 0
    # no farther from the reference loop run in float64 than the fp32 loop is (tests/support/tolerances.py); three
    # steps leave the losses within a few units of fp32, where the order of a loss's mean over its tokens decides
    assert_loss_no_farther(exact_run(config(), steps=3)[0], ref_losses, losses, terms=c.batch_size * c.seq_len)


def test_wrapping_an_nnx_optimizer_trains_and_syncs_back_into_the_model(tmp_path):
    c = config(params="host", optimizer="nvme", nvme_path=str(tmp_path))
    model = nnx.bridge.ToNNX(models.build(c.model), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, next(batches(c))[:, :-1])
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict())
    optimizer = nnx.Optimizer(model, optax.adamw(c.lr), wrt=nnx.Param)
    data, losses = batches(c), []
    with zinfjax.wrap(optimizer, c, model=model) as state:
        for _ in range(4):
            state, metrics = state.train_step(next(data))
            losses.append(metrics["loss"])
        synced = state.sync()
    after = nnx.state(model, nnx.Param).to_pure_dict()
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(synced), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(before["embed"]["wte"]["embedding"], after["embed"]["wte"]["embedding"])
