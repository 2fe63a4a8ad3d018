import jax
import numpy as np
import pytest

from zinfjax import Config, models
from zinfjax.data import Batches, load_tokens
from zinfjax.in_memory import init_state, make_step
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.optim import make_optimizer
from zinfjax.sharding import make_mesh
from zinfjax.train import run


def losses_on(devices, config, steps=4):
    model = models.build(config.model)
    mesh = make_mesh({"data": len(devices)}, devices)
    tx = make_optimizer(config)
    params, opt_state = init_state(lm_init(model), tx, mesh, config.seed)
    step = make_step(lm_loss(model), tx, mesh, config.grad_accum)
    batches = Batches(load_tokens("demo"), config.batch_size, config.seq_len, config.seed)
    out = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, next(batches))
        out.append(float(loss))
    return out, params


@pytest.mark.parametrize("model,accum", [("gpt2-tiny", 1), ("llama-tiny", 2)])
def test_data_parallel_on_8_devices_equals_1_device(model, accum):
    config = Config(model=model, batch_size=16, seq_len=16, grad_accum=accum, grad_clip=1.0)
    one, p1 = losses_on(jax.devices()[:1], config)
    eight, p8 = losses_on(jax.devices()[:8], config)
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_reference_trainer_loss_falls_on_the_demo_corpus(tmp_path):
    log = run(Config(model="gpt2-tiny", steps=40, batch_size=8, seq_len=64, lr=3e-3,
                     log=str(tmp_path / "log.json")), progress=False)
    losses = [s["loss"] for s in log["steps"]]
    assert np.mean(losses[-5:]) < losses[0] - 1.0
    assert (tmp_path / "log.json").exists() and (tmp_path / "log.png").stat().st_size > 1000
