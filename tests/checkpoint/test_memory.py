"""A save in flight does not double the device or host state (docs/checkpoint.md, "Memory").

The checkpoint's background thread is held back for a second by a task queued before the save, so
the next step's updates reach every layer while none has been written yet: the case in which a
save that kept references to the old arrays held two copies of the state. Counted with JAX's own
live-buffer list after each computation the engine dispatches, as `test_device_bound` counts.
"""

import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.support.engine_helpers import batches, config
from zinfjax import models
from zinfjax.checkpoint import CheckpointManager
from zinfjax.models import ModelConfig
from zinfjax.sharding import make_mesh
from zinfjax.trainers.streaming import lm_engine

LAYERS = 8
SHAPE = (96, 288)  # one layer of blocks/fc/kernel


def _engine(tier: str):
    c = config(mesh="data:1", params=tier, optimizer=tier, gradients=tier, activations=tier)
    model = models.build(ModelConfig.named("gpt2-tiny").replace(n_layers=LAYERS, d_model=96, d_ff=288))
    return lm_engine(model, c, make_mesh(c.mesh_axes())), c


def _counting(engine) -> dict:
    """Patches the engine's dispatch to record the peak of live fc-kernel-sized fp32 arrays."""
    seen = {"peak": 0}
    dispatch = engine._dispatch

    def counted(*args):
        out = dispatch(*args)
        live = sum(1 for x in jax.live_arrays() if x.shape == SHAPE and x.dtype == np.float32)
        seen["peak"] = max(seen["peak"], live)
        return out

    engine._dispatch = counted
    return seen


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_save_in_flight_holds_at_most_a_layer_more_and_saves_the_state_it_took(tmp_path, tier):
    engine, c = _engine(tier)
    data = batches(c)
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    try:
        engine.train_step(next(data))
        idle = _counting(engine)
        engine.train_step(next(data))  # the peak of a step without a save
        baseline = idle["peak"]
        saved = jax.tree.map(np.asarray, engine.params())
        gate = threading.Event()
        manager._executor.submit(gate.wait)  # the save's thread is busy for a second
        manager.save(engine)
        threading.Timer(1.0, gate.set).start()
        during = _counting(engine)
        metrics = engine.train_step(next(data))
        manager.wait()
    finally:
        manager.close()
        engine.close()
    # fp32: a layer holds three fc kernels (the parameter, which is the master, Adam's m and v), and
    # a second copy of the state would add up to LAYERS x 3. Measured (device tier): 33 with the save
    # in flight, 33 without; 54 when the save kept the old arrays until it wrote them.
    assert during["peak"] <= baseline + 3, (during["peak"], baseline)
    assert metrics["step_s"] >= 0.9  # the update waited for the save to reach its layers
    plain = ocp.PyTreeCheckpointer().restore(str(tmp_path / "ckpt" / "2" / "params"))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)
