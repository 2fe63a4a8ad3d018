"""``host_link_bytes``: the bytes a step moves between host memory and the compute devices."""

import jax
import numpy as np

from tests.engine_helpers import batches, config, make_engine
from zinfjax.engine.telemetry import host_link_bytes


def test_host_link_bytes_count_every_byte_to_and_from_the_host_tiers(tmp_path):
    """bf16, params on device, optimizer state on host: the link carries the optimizer state both ways."""
    c = config(mesh="data:1", precision="bf16", optimizer="host", params="device")
    engine = make_engine(c)
    try:
        metrics = engine.train_step(next(batches(c)))
        opt_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.opt_state()))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.params()))
    finally:
        engine.close()
    assert metrics["host_link_bytes"] == metrics["read_bytes_host"] + metrics["write_bytes_host"]
    assert "read_bytes_nvme" not in metrics or metrics["read_bytes_nvme"] == 0
    # fp32 master, Adam m and v (12 B per parameter) read once and written once; the step count is tiny.
    assert metrics["read_bytes_host"] >= opt_bytes - 64 and metrics["write_bytes_host"] >= opt_bytes - 64
    assert 2 * 12 * n <= metrics["host_link_bytes"] <= 2 * 12 * n + 4096


def test_host_link_bytes_leave_the_device_tier_out():
    assert host_link_bytes({"read_bytes_device": 7, "read_bytes_host": 5, "write_bytes_nvme": 3}) == 8
