"""Bad input is refused before training starts, with an error that names the problem and the fix."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zinfjax
from tests.support.engine_helpers import config, make_engine
from tests.support.mounts import tmpfs
from zinfjax import BatchError, ProgramError, WrapError
from zinfjax.store import BufferBudgetError, StorePathError, StoreSpaceError


def files_under(path):
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def test_a_disk_that_cannot_hold_the_state_is_refused_with_bytes_needed_and_free(tmp_path):
    with tmpfs(tmp_path / "small", "1M") as mnt:
        c = config(params="nvme", optimizer="nvme", nvme_path=str(mnt))
        with pytest.raises(StoreSpaceError, match=r"needs \d+ bytes but only \d+ are free"):
            make_engine(c)
        assert files_under(mnt) == []


def test_an_unwritable_path_is_refused(tmp_path):
    with tmpfs(tmp_path / "ro", "1M", read_only=True) as mnt:
        c = config(params="nvme", nvme_path=str(mnt / "run"))
        with pytest.raises(StorePathError, match="nvme_path"):
            make_engine(c)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StorePathError, match="nvme_path"):
        make_engine(config(optimizer="nvme", nvme_path=str(tmp_path / "file" / "run")))


def test_buffers_that_cannot_hold_one_layer_are_refused_before_writing(tmp_path):
    c = config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "nv"), host_buffer_bytes="4KiB")
    with pytest.raises(BufferBudgetError, match="cannot hold one layer.*at least \\d+"):
        make_engine(c)
    assert not (tmp_path / "nv").exists()


class Unscanned(nn.Module):
    """Blocks written as a Python loop: parameters layers_0 ... layers_2, nothing stacked."""

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = x + nn.Dense(4)(x)
        return x


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(4)(h), None


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
        h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(x, None)
        return nn.Dense(2)(h)


def linen_state(model, x):
    params = model.init(jax.random.key(0), x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def test_a_model_whose_blocks_are_a_python_loop_is_refused_naming_nn_scan():
    state = linen_state(Unscanned(), jnp.zeros((2, 4)))
    wrapped = zinfjax.wrap(state, config(), loss_fn=lambda p, b: jnp.mean(state.apply_fn({"params": p}, b) ** 2))
    with pytest.raises(ProgramError, match="flax.linen.scan.*nnx.scan"):
        wrapped.train_step(np.ones((8, 4), np.float32))


def test_wrap_without_a_loss_for_a_model_of_your_own_names_loss_fn():
    state = linen_state(Tower(), jnp.zeros((2, 4)))
    with pytest.raises(WrapError, match="loss_fn"):
        zinfjax.wrap(state, config())
    with pytest.raises(WrapError, match="TrainState"):
        zinfjax.wrap(object(), config())


def tower_wrapped(loss):
    state = linen_state(Tower(), jnp.zeros((2, 4)))
    return zinfjax.wrap(state, config(mesh="data:1"), loss_fn=lambda p, b: loss(state.apply_fn({"params": p}, b["x"]),
                                                                                  b))


def test_a_loss_that_is_not_a_scalar_is_refused():
    wrapped = tower_wrapped(lambda out, b: out)
    with pytest.raises(ProgramError, match="float scalar.*mean"):
        wrapped.train_step({"x": np.ones((8, 4), np.float32)})


def test_a_batch_whose_leaves_disagree_on_the_batch_axis_is_refused():
    wrapped = tower_wrapped(lambda out, b: jnp.mean((out - b["y"]) ** 2))
    with pytest.raises(BatchError, match="disagree on the batch axis.*\\[4, 8\\]"):
        wrapped.train_step({"x": np.ones((8, 4), np.float32), "y": np.ones((4, 2), np.float32)})


def test_a_batch_of_another_shape_than_the_first_is_refused():
    wrapped = tower_wrapped(lambda out, b: jnp.mean((out - b["y"]) ** 2))
    wrapped.train_step({"x": np.ones((8, 4), np.float32), "y": np.ones((8, 2), np.float32)})
    with pytest.raises(BatchError, match="wrapped for float32\\[8, 4\\]"):
        wrapped.train_step({"x": np.ones((8, 5), np.float32), "y": np.ones((8, 2), np.float32)})
    wrapped.close()


def test_parameters_that_change_structure_between_layers_cannot_be_stacked():
    with pytest.raises(zinfjax.UserError, match="stack_layers.*identical"):
        zinfjax.stack_layers({"layers_0": {"w": np.ones((2, 2))}, "layers_1": {"w": np.ones((3, 2))}})
