"""The host memory budget (`zinfjax.engine.budget`): from one number, the engine's buffers, read-ahead and writes in
flight; a budget that cannot train the model refused before anything is written."""

import pytest

from tests.support.engine_helpers import config
from zinfjax import models
from zinfjax.engine.budget import MAX_DEPTH, MemoryBudgetError
from zinfjax.runtime import rss
from zinfjax.sections import Memory
from zinfjax.sharding import make_mesh
from zinfjax.trainers.streaming import lm_engine

NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")


def test_a_budget_below_the_minimum_is_refused_before_anything_is_written(tmp_path):
    c = config(nvme_path=str(tmp_path / "nv"), memory_limit="100MiB", **NVME)
    with pytest.raises(MemoryBudgetError, match=r"memory budget of 100\.0 MiB.*smallest budget that would work is "
                                                 r"\d+(\.\d+)? [MG]iB"):
        lm_engine(models.build(c.model), c, make_mesh(c.mesh_axes()))
    assert not (tmp_path / "nv").exists()


def test_the_budget_sets_buffers_and_read_ahead_unless_given(tmp_path):
    limit = rss.current_bytes() + (2 << 30)  # a budget above what this test process already holds
    auto = config(nvme_path=str(tmp_path / "a"), memory_limit=limit, **NVME)
    engine = lm_engine(models.build(auto.model), auto, make_mesh(auto.mesh_axes()))
    assert engine.budget.source == "memory_limit" and engine.budget.prefetch_depth == MAX_DEPTH
    assert engine.budget.host_buffer_bytes >= engine.stores.pool.capacity_bytes > 0
    assert engine.settings.memory == auto.section(Memory)  # what the budget derived is its own, not the settings
    engine.close()
    given = config(nvme_path=str(tmp_path / "b"), memory_limit=limit, prefetch_depth=1, host_buffer_bytes="8MiB",
                   **NVME)
    engine = lm_engine(models.build(given.model), given, make_mesh(given.mesh_axes()))
    assert (engine.budget.prefetch_depth, engine.budget.host_buffer_bytes) == (1, 8 << 20)
    engine.close()


def test_a_budget_just_above_the_minimum_is_lean_and_one_above_it_reads_ahead():
    """The budget's three regimes, from its own arithmetic (gpt2-small-sized slices)."""
    from zinfjax.engine.budget import LIVE_PER_DEPTH, make_budget, minimum_bytes

    read, write, base = 84 << 20, 56 << 20, 300 << 20
    least = minimum_bytes(base, 0, read, write)
    lean = make_budget(Memory(memory_limit=least + (10 << 20)), read, write, baseline=base)
    assert lean.lean and lean.prefetch_depth == 1 and lean.host_buffer_bytes == lean.write_bytes_in_flight == write
    roomy = make_budget(Memory(memory_limit=least + 2 * write + 2 * LIVE_PER_DEPTH * read), read, write, baseline=base)
    assert not roomy.lean and roomy.prefetch_depth == 3 and roomy.write_bytes_in_flight == 2 * write
    with pytest.raises(MemoryBudgetError, match=r"smallest budget that would work is 940\.0 MiB"):
        make_budget(Memory(memory_limit=least - 1), read, write, baseline=base)
