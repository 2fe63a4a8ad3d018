"""Bad input is refused before training starts, with an error that names the problem and the fix."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import zinfjax
from tests.engine_helpers import config, initial_params
from tests.mounts import tmpfs
from zinfjax import LayeredConventionError, NotElementwiseError, models
from zinfjax.engine import Engine
from zinfjax.sharding import make_mesh
from zinfjax.store import BufferBudgetError, StorePathError, StoreSpaceError


def make_engine(c, tx=None):
    model = models.build(c.model)
    return Engine(model.layers(), initial_params(c), tx or optax.adam(1e-3), c, make_mesh(c.mesh_axes()),
                  (c.batch_size, c.seq_len + 1))


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


def test_a_transformation_that_is_not_elementwise_is_refused(tmp_path):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    with pytest.raises(NotElementwiseError, match="Config.grad_clip"):
        make_engine(config(), tx)


class Unlayered(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


def test_a_model_without_the_layered_convention_is_refused_with_a_pointer_to_the_docs():
    model = Unlayered()
    params = model.init(jax.random.key(0), jnp.zeros((1, 4)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    with pytest.raises(LayeredConventionError, match="layers\\(\\).*docs/layered.md"):
        zinfjax.wrap(state, config())
    with pytest.raises(LayeredConventionError, match="TrainState"):
        zinfjax.wrap(object(), config())
