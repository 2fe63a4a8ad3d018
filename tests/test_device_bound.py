"""Invariant 2 on the device: a step holds a bounded number of layers there, whatever the layer count.

Counted with JAX's own live-buffer list (`jax.live_arrays`): after each computation the engine
dispatches, the live device-memory arrays of one block leaf's slice shape in the compute dtype
(bf16: the master and Adam state are fp32, so these are the layer's compute copy, its gradient and
its updated copy). Streaming from host memory or NVMe, that count depends on the read-ahead
(``prefetch_depth``), not on the layers: 12 and 24 layers peak alike, far below the layer count.
Measured (2 steps, peak): host 5 and 8, nvme 6 and 10 at depth 1 and 3.
"""

import jax
import pytest

from tests.engine_helpers import batches, config
from zinfjax import models
from zinfjax.models import ModelConfig
from zinfjax.sharding import make_mesh
from zinfjax.train import lm_engine

PER_LAYER = 3  # the compute copy read, its gradient, the updated copy being written


def peak_live_slices(tmp_path, tier: str, depth: int, layers: int) -> int:
    c = config(mesh="data:1", params=tier, optimizer=tier, gradients=tier, activations=tier, prefetch_depth=depth,
               nvme_path=str(tmp_path / f"{layers}"), precision="bf16")
    model = models.build(ModelConfig.named("gpt2-tiny").replace(n_layers=layers, d_model=96, d_ff=288))
    engine = lm_engine(model, c, make_mesh(c.mesh_axes()))
    shape, dtype = (96, 288), jax.numpy.bfloat16  # one layer of blocks/fc/kernel in the compute dtype
    peak = 0
    dispatch = engine._dispatch

    def counted(*args):
        nonlocal peak
        out = dispatch(*args)
        live = sum(1 for x in jax.live_arrays()
                   if x.shape == shape and x.dtype == dtype and x.sharding.memory_kind == "device")
        peak = max(peak, live)
        return out

    engine._dispatch = counted
    try:
        data = batches(c)
        for _ in range(2):
            engine.train_step(next(data))
    finally:
        engine.close()
    return peak


@pytest.mark.parametrize("tier,depth", [("host", 1), ("nvme", 3), pytest.param("host", 3, marks=pytest.mark.wide),
                                        pytest.param("nvme", 1, marks=pytest.mark.wide)])
def test_live_layers_on_the_device_follow_the_read_ahead_not_the_layers(tmp_path, tier, depth):
    short, long = peak_live_slices(tmp_path, tier, depth, 12), peak_live_slices(tmp_path, tier, depth, 24)
    assert 0 < long <= PER_LAYER * (depth + 2) < 24, (short, long)
    assert long <= short + 1, (short, long)  # twice the layers, the same peak
