import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.float64_twin import assert_float64
from tests.support.tolerances import assert_no_farther, assert_run_no_farther, in_float64, loss_distance
from zinfjax import Config, models
from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.data import Batches, load_tokens
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.sharding import make_mesh, replicated
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax.trainers.reference import ReferenceTrainer, init_state, make_step
from zinfjax.training.loop import run


def _loop(built, tx, mesh, config, params, steps, accum=1):
    """The plain loop of ``built`` from ``params``: losses and parameters (numpy) after ``steps``."""
    params = jax.device_put(params, replicated(mesh))
    opt_state = jax.jit(tx.init, out_shardings=replicated(mesh))(params)
    step = make_step(lm_loss(built), tx, mesh, accum)
    batches, losses = Batches(load_tokens("demo"), config.batch_size, config.seq_len, config.seed), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, next(batches))
        losses.append(float(loss))
    return losses, jax.tree.map(np.asarray, params)


def _exact(loop, model: str, *args):
    """``loop(built, *args)`` in float64 under ``jax.enable_x64``: ``args`` hold the fp32 initial parameters, cast
    (the exact run that fp32 runs are judged against, tests/support/tolerances.py)."""
    with jax.enable_x64(True):
        losses, params = loop(models.build(model, jnp.float64), *args)
    assert_float64(params)
    return losses, params


def losses_on(devices, config, steps=4, exact=False):
    mesh = make_mesh({"data": len(devices)}, devices)
    tx = make_optimizer(config)
    params, _ = init_state(lm_init(models.build(config.model)), tx, mesh, config.seed)
    if exact:
        return _exact(_loop, config.model, tx, mesh, config, in_float64(params), steps, config.grad_accum)
    return _loop(models.build(config.model), tx, mesh, config, params, steps, config.grad_accum)


# make test runs gpt2 with micro-batches (the accumulation and the data split in one run); the wide corners, for
# make test-all, are gpt2 without micro-batches and llama with them.
@pytest.mark.numeric
@pytest.mark.parametrize("model,accum", [("gpt2-tiny", 2), pytest.param("gpt2-tiny", 1, marks=pytest.mark.wide),
                                         pytest.param("llama-tiny", 2, marks=pytest.mark.wide)])
def test_data_parallel_on_8_devices_equals_1_device(model, accum):
    """8 devices sum the gradients in another order than 1: no farther from the 1-device loop in float64 than the
    1-device fp32 loop is."""
    config = Config(model=model, batch_size=16, seq_len=16, grad_accum=accum, grad_clip=1.0)
    one = losses_on(jax.devices()[:1], config)
    eight = losses_on(jax.devices()[:8], config)
    assert_run_no_farther(losses_on(jax.devices()[:1], config, exact=True), one, eight)


def test_reference_trainer_loss_falls_on_the_demo_corpus(tmp_path):
    log = run(Config(model="gpt2-tiny", steps=40, batch_size=8, seq_len=64, lr=3e-3,
                     log=str(tmp_path / "log.json")), progress=False)
    losses = [s["loss"] for s in log["steps"]]
    assert np.mean(losses[-5:]) < losses[0] - 1.0
    assert (tmp_path / "log.json").exists() and (tmp_path / "log.png").stat().st_size > 1000


def _plain_run(built, tx, mesh, config, steps, exact=False):
    """The plain loop (whole-model autodiff, no remat): losses and parameters after ``steps``; in float64 from the
    same fp32 initial parameters where ``exact``."""
    params, _ = init_state(lm_init(built), tx, mesh, config.seed)
    if exact:
        return _exact(_loop, config.model, tx, mesh, config, in_float64(params), steps)
    return _loop(built, tx, mesh, config, params, steps)


# make test runs gpt2 in fp32 and bf16; llama (the same remat of each block, over another block) is the wide corner,
# for make test-all.
@pytest.mark.numeric
@pytest.mark.parametrize("model,precision", [("gpt2-tiny", "fp32"),
                                             pytest.param("llama-tiny", "fp32", marks=pytest.mark.wide),
                                             pytest.param("gpt2-tiny", "bf16",
                                                          marks=[pytest.mark.low_precision, pytest.mark.wide])])
def test_the_trainer_keeps_each_blocks_products_and_follows_the_plain_loop(model, precision):
    """`zinfjax train`'s in-memory step differentiates through ``nn.remat`` (each block keeps its products and
    recomputes the rest); it follows the plain loop of the same model to float32 rounding in fp32. In bf16 the
    recomputed values round where XLA fuses them, and five steps compound that: no farther from the fp32 loop
    than the plain bf16 loop is (tests.support.tolerances)."""
    config = Config(model=model, batch_size=8, seq_len=32, precision=precision, mesh="data:1")
    built = models.build(config.model, COMPUTE_DTYPES[precision])
    mesh = make_mesh(config.mesh_axes())
    trainer = ReferenceTrainer(config, built, mesh)
    tokens = jax.numpy.zeros((2, 9), jax.numpy.int32)
    jaxpr = str(jax.make_jaxpr(trainer.loss)(trainer.params, tokens))
    assert re.search(r"\b(checkpoint|remat2?)\[", jaxpr)  # jax.checkpoint's primitive: the products are kept
    batches = Batches(load_tokens("demo"), config.batch_size, config.seq_len, config.seed)
    got = [trainer.step(next(batches))["loss"] for _ in range(5)]
    want, params = _plain_run(built, trainer.tx, mesh, config, 5)
    if precision == "fp32":  # XLA fuses the recomputation: no farther from the plain loop in float64 than it is
        exact = _plain_run(built, trainer.tx, mesh, config, 5, exact=True)
        assert_run_no_farther(exact, (want, params), (got, jax.tree.map(np.asarray, trainer.params)))
        return
    exact_losses, exact_params = _plain_run(models.build(config.model), trainer.tx, mesh, config, 5)
    assert_no_farther(exact_params, params, trainer.params)
    assert_no_farther(exact_losses, want, got, loss_distance)
