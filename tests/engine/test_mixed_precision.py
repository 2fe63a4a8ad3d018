"""Mixed precision through the engine, against an in-memory loop with the same master, compute copy and loss scale.

The reference keeps fp32 master weights, runs the loss on their bf16 (or fp16) copy, scales the
loss by the fp16 loss scale, unscales the fp32 gradients, skips a step whose gradients are not
finite, and updates the master with optax: what the engine does, one layer at a time.

Tolerances, and why. XLA's CPU backend computes bf16 and fp16 arithmetic in fp32 and rounds to the
compute dtype where a value leaves a fused computation, so where values are rounded depends on how
XLA fuses each jitted function (the engine's per-layer functions and the whole-model step round in
different places) and on which kernels the CPU has. Ten Adam steps compound those roundings, and no
a-priori bound follows from bf16's spacing; so the engine is held to the reference instead
(``tests.support.tolerances``): its master and its losses are no farther from the same run in fp32
than the mixed reference's are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.support.engine_helpers import assert_bitwise, batches, config, make_engine, relative_error
from tests.support.tolerances import assert_no_farther, loss_distance
from zinfjax import models
from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.checkpoint import CheckpointManager, CheckpointSource
from zinfjax.engine import LossScale
from zinfjax.models.stacked import lm_init, lm_loss

STEPS = 10


def mixed_reference(c, steps=STEPS):
    """The in-memory mixed-precision loop (see the module docstring): losses, fp32 master, final loss scale."""
    dtype = COMPUTE_DTYPES[c.precision]
    loss = lm_loss(models.build(c.model, dtype))
    master = jax.jit(lm_init(models.build(c.model)))(jax.random.key(c.seed))
    tx = optax.adamw(c.lr)
    opt, scale = tx.init(master), LossScale(c.precision == "fp16")

    @jax.jit
    def grads_of(master, batch, s):
        compute = jax.tree.map(lambda x: x.astype(dtype), master)
        value, grads = jax.value_and_grad(lambda p: loss(p, batch) * s)(compute)
        return value / s, jax.tree.map(lambda g: g.astype(jnp.float32) / s, grads)

    @jax.jit
    def update(master, grads, opt):
        updates, opt = tx.update(grads, opt, master)
        return optax.apply_updates(master, updates), opt

    losses, data = [], batches(c)
    for _ in range(steps):
        value, grads = grads_of(master, next(data), jnp.float32(scale.value))
        finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
        scale.after_step(finite)
        if finite:
            master, opt = update(master, grads, opt)
        losses.append(float(value))
    return losses, jax.tree.map(np.asarray, master), scale.value


def engine_losses(c, steps=STEPS):
    engine, data = make_engine(c, tx=optax.adamw(c.lr)), batches(c)
    try:
        losses = [engine.train_step(next(data))["loss"] for _ in range(steps)]
        return losses, jax.tree.map(np.asarray, engine.params()), engine.loss_scale.value
    finally:
        engine.close()


def _reads_per_step(c, steps: int = 3):
    """Losses, the master, and the bytes one step reads from the parameters' (compute copy's) stores."""
    engine, data = make_engine(c), batches(c)
    try:
        losses = [engine.train_step(next(data))["loss"] for _ in range(steps - 1)]
        before = sum(s.stats.bytes_read for s in engine.stores.params.values())
        losses.append(engine.train_step(next(data))["loss"])
        read = sum(s.stats.bytes_read for s in engine.stores.params.values()) - before
        streamed = sum(s.layer_nbytes * s.num_layers for g, s in engine.stores.params.items()
                       if engine.program.groups[g].streamed)
        return losses, jax.tree.map(np.asarray, engine.params()), read, streamed
    finally:
        engine.close()


@pytest.mark.parametrize("mesh, stage", [pytest.param("data:1", 0, marks=pytest.mark.wide), ("data:2", 3)])
def test_the_backward_casts_the_compute_copy_from_the_master_the_update_reads(tmp_path, mesh, stage):
    """With the compute copy on NVMe, a layer's backward takes it from the fp32 master its fused update reads,
    cast as the update casts it, instead of reading it again: the run is bit for bit the one that reads it
    (every tier on host, where a read costs nothing and the engine reads), with one streamed compute copy
    fewer read per step."""
    base = config(mesh=mesh, stage=stage, precision="bf16")
    host = base.replace(params="host", optimizer="host", gradients="host", activations="host")
    # max_reuse_distance=0: the head's chunks read twice on both sides, so the cast is the one difference.
    nvme = base.replace(params="nvme", optimizer="nvme", activations="nvme", nvme_path=str(tmp_path / "nvme"),
                        max_reuse_distance=0)
    host_losses, host_params, host_read, streamed = _reads_per_step(host)
    nvme_losses, nvme_params, nvme_read, _ = _reads_per_step(nvme)
    assert nvme_losses == host_losses
    assert_bitwise(nvme_params, host_params)
    assert host_read - nvme_read == streamed, (host_read, nvme_read, streamed)


# The last case splits each block's products over two devices (tensor parallelism) with their own VJP
# (zinfjax.models.products), against the loop on one device.
@pytest.mark.low_precision
@pytest.mark.parametrize("precision, mesh", [("bf16", "data:1"), ("fp16", "data:1"),
                                              pytest.param("bf16", "data:1,model:2", marks=pytest.mark.wide)])
def test_mixed_precision_engine_equals_the_in_memory_mixed_loop(tmp_path, precision, mesh):
    c = config(precision=precision, mesh=mesh, params="nvme", optimizer="nvme", nvme_path=str(tmp_path))
    ref_losses, ref_master, ref_scale = mixed_reference(c)
    losses, master, scale = engine_losses(c)
    fp32_losses, fp32_master, _ = mixed_reference(c.replace(precision="fp32"))
    assert scale == ref_scale
    for name, exact, ref, got, distance in [("master", fp32_master, ref_master, master, relative_error),
                                            ("losses", fp32_losses, ref_losses, losses, loss_distance)]:
        ref_error, error = assert_no_farther(exact, ref, got, distance)
        print(f"{precision} {mesh} {name} from fp32: reference {ref_error:.2e}, engine {error:.2e}")


def fp16_engine(tmp_path, **kw):
    c = config(precision="fp16", mesh="data:1", params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "nv"),
               **kw)
    return c, make_engine(c, tx=optax.adamw(c.lr))


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    c, engine = fp16_engine(tmp_path)
    data = batches(c)
    try:
        engine.train_step(next(data))
        before = jax.tree.map(np.asarray, engine.params())
        engine.loss_scale.scale = 2.0**60  # gradients times 2^60 overflow fp16 (max 65504)
        metrics = engine.train_step(next(data))
        assert metrics["skipped"] and engine.step_count == 1
        assert engine.loss_scale.scale == 2.0**59
        after = jax.tree.map(np.asarray, engine.params())
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)  # a skipped step changes nothing
    finally:
        engine.close()


def test_fp16_scale_doubles_after_its_window_of_good_steps(tmp_path):
    c, engine = fp16_engine(tmp_path)
    data = batches(c)
    try:
        engine.loss_scale.scale, engine.loss_scale.window = 2.0**10, 2  # far from overflow, so no step is skipped
        start = engine.loss_scale.scale
        scales = []
        for _ in range(4):
            assert not engine.train_step(next(data))["skipped"]
            scales.append(engine.loss_scale.scale)
        assert scales == [start, 2 * start, 2 * start, 4 * start]
    finally:
        engine.close()


def test_fp16_loss_scale_state_survives_a_checkpoint(tmp_path):
    c, engine = fp16_engine(tmp_path)
    data = batches(c)
    try:
        engine.loss_scale.scale, engine.loss_scale.good = 2.0**10, 7
        engine.train_step(next(data))
        with CheckpointManager(str(tmp_path / "ckpt")) as manager:
            manager.save(engine)
        saved = (engine.loss_scale.scale, engine.loss_scale.good)
    finally:
        engine.close()
    restored = make_engine(c.replace(nvme_path=str(tmp_path / "nv2")), tx=optax.adamw(c.lr),
                           source=lambda program, plan: CheckpointSource(str(tmp_path / "ckpt"), program, plan))
    try:
        assert (restored.loss_scale.scale, restored.loss_scale.good) == saved == (2.0**10, 8)
    finally:
        restored.close()
