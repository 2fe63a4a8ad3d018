"""Invariant 2 on the device: a step holds a bounded number of layers there, whatever the layer count.

Counted with JAX's own live-buffer list (`jax.live_arrays`): after each computation the engine
dispatches, the live device-memory arrays of one block leaf's slice shape in the compute dtype
(bf16: the master and Adam state are fp32, so these are the layer's compute copy, its gradient and
its updated copy). Streaming from host memory or NVMe, that count depends on the read-ahead
(``prefetch_depth``), not on the layers. The read-ahead keeps ``depth`` operations in flight, and
more while they hold no more bytes than ``depth`` of the largest operation's reads
(`zinfjax.engine.readahead`): a forward layer reads the bf16 copy alone, a seventh of a backward
layer with its update, so up to 7 x depth forward layers are read ahead, and the peak levels off
once the model has more layers than that. On the CPU backend the host tier's own layers are in device
memory too (`host_tier_kind`); the arrays it holds are its storage and are not counted. Measured (3
warm steps, peak, several runs): depth 1, 16 and 32 layers: 7-9 (nvme); depth 3, 32 and 64 layers:
15-21 (nvme), never above the bound of 3 + 7 x depth, and no higher at 96 layers. Which of the two
models peaks higher varies from run to run with when the reads complete.
"""

import jax
import pytest

from tests.support.engine_helpers import batches, config
from zinfjax import models
from zinfjax.models import ModelConfig
from zinfjax.sharding import make_mesh
from zinfjax.trainers.streaming import lm_engine

PER_LAYER = 3  # the compute copy read, its gradient, the updated copy being written
# A backward layer with its update reads the bf16 copy (2 bytes a parameter), the fp32 master (4) and
# Adam's m and v (8): the bytes of 7 forward layers, which read the bf16 copy alone.
AHEAD_PER_DEPTH = 7
STEPS = 3  # counted, after one that compiles


def held_by_stores(engine) -> set[int]:
    """The buffers the memory tiers hold: on the CPU backend the host tier keeps its layers in device memory
    (`zinfjax.store.layout.host_tier_kind`), and they are the tier's storage, not the step's working set. A
    read hands out the held array itself, so identity finds them (a buffer's address would wait for it)."""
    return {id(x) for store in engine.stores.all() if store.tier == "host"
            for layer in store._layers if layer for x in layer if x is not None}


def peak_live_slices(tmp_path, tier: str, depth: int, layers: int) -> int:
    c = config(mesh="data:1", params=tier, optimizer=tier, gradients=tier, activations=tier, prefetch_depth=depth,
               nvme_path=str(tmp_path / f"{layers}"), precision="bf16")
    model = models.build(ModelConfig.named("gpt2-tiny").replace(n_layers=layers, d_model=96, d_ff=288))
    engine = lm_engine(model, c, make_mesh(c.mesh_axes()))
    shape, dtype = (96, 288), jax.numpy.bfloat16  # one layer of blocks/fc/kernel in the compute dtype
    peak, counting = 0, False
    dispatch = engine._dispatch

    def counted(*args):
        nonlocal peak
        out = dispatch(*args)
        if not counting:
            return out
        stored = held_by_stores(engine)
        live = sum(1 for x in jax.live_arrays() if x.shape == shape and x.dtype == dtype
                   and x.sharding.memory_kind == "device" and id(x) not in stored)
        peak = max(peak, live)
        return out

    engine._dispatch = counted
    try:
        data = batches(c)
        engine.train_step(next(data))
        # Counted from the second step on: the first compiles every stage function, which the second
        # model (the same layers, more of them) then reuses, so only warm steps compare like with like.
        counting = True
        for _ in range(STEPS):
            engine.train_step(next(data))
    finally:
        engine.close()
    return peak


@pytest.mark.parametrize("tier,depth", [pytest.param("host", 1, marks=pytest.mark.wide), ("nvme", 1),
                                        pytest.param("host", 3, marks=pytest.mark.wide),
                                        pytest.param("nvme", 3, marks=pytest.mark.wide)])
def test_live_layers_on_the_device_follow_the_read_ahead_not_the_layers(tmp_path, tier, depth):
    layers = 16 if depth == 1 else 32  # well more than the forward layers the read-ahead may hold
    short, long = peak_live_slices(tmp_path, tier, depth, layers), peak_live_slices(tmp_path, tier, depth, 2 * layers)
    # Neither run holds more than the read-ahead allows, which is fewer than either model's layers. How far
    # the window has filled when a computation is dispatched depends on when its reads complete, so the
    # two peaks differ by a few slices from run to run, either way (module docstring).
    bound = PER_LAYER + AHEAD_PER_DEPTH * depth
    assert 0 < short <= bound < layers and 0 < long <= bound, (short, long)
