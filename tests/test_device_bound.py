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
memory too (`host_tier_kind`); the arrays it holds are its storage and are not counted. Measured (2
steps, peak): depth 1, 12 and 24 layers: 8 and 8 (host and nvme); depth 3, 24 and 48 layers: 22 and
21 (nvme), 12 layers: 13.
"""

import jax
import pytest

from tests.engine_helpers import batches, config
from zinfjax import models
from zinfjax.models import ModelConfig
from zinfjax.sharding import make_mesh
from zinfjax.train import lm_engine

PER_LAYER = 3  # the compute copy read, its gradient, the updated copy being written
# A backward layer with its update reads the bf16 copy (2 bytes a parameter), the fp32 master (4) and
# Adam's m and v (8): the bytes of 7 forward layers, which read the bf16 copy alone.
AHEAD_PER_DEPTH = 7


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
    peak = 0
    dispatch = engine._dispatch

    def counted(*args):
        nonlocal peak
        out = dispatch(*args)
        stored = held_by_stores(engine)
        live = sum(1 for x in jax.live_arrays() if x.shape == shape and x.dtype == dtype
                   and x.sharding.memory_kind == "device" and id(x) not in stored)
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
    layers = 12 if depth == 1 else 24  # more than the forward layers the read-ahead may hold
    short, long = peak_live_slices(tmp_path, tier, depth, layers), peak_live_slices(tmp_path, tier, depth, 2 * layers)
    assert 0 < long <= PER_LAYER + AHEAD_PER_DEPTH * depth < 2 * layers, (short, long)
    assert long <= short + 1, (short, long)  # twice the layers, the same peak
