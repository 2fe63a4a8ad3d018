"""Invariant 2: with the state on NVMe, host memory grows neither with the layers nor with the vocabulary.

Each configuration trains through ``zinfjax train`` in its own process (a user's path, with the
defaults), so each peak RSS belongs to one configuration alone; the JSON log records the peak of
initialisation and of every step. The models are wide enough that their state (fp32 params +
Adam m, v) dwarfs what a JAX process needs anyway: doubling the layers, or the vocabulary, adds
more state than 10% of the peak, and must raise the peak by less than 10%.

The smaller model already has more layers (16) and vocabulary chunks (16) than the engine holds at
once (its read-ahead, the computations queued behind it and the writes in flight: about 11 slices
at the budget given here), so the comparison is of the steady state.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

from tests.support.engine_helpers import config, make_engine
from zinfjax.benchmarks.children import one_device_env
from zinfjax.engine.budget import (
    HEAP_RESIDENT_FRACTION,
    LIVE_PER_DEPTH,
    Budget,
    heap_room,
    make_budget,
    memory_capped,
    minimum_bytes,
)
from zinfjax.models import ModelConfig
from zinfjax.runtime import allocator, rss
from zinfjax.sections import Memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDE = dict(d_model=384, max_seq_len=64, n_heads=6, d_ff=1536)


def train(model: ModelConfig, tmp_path, name: str) -> dict:
    """3 steps of ``zinfjax train`` with every tier on NVMe; the log's figures."""
    model_file = tmp_path / f"{name}.json"
    model_file.write_text(json.dumps(model.__dict__))
    log = tmp_path / f"{name}-log.json"
    env = one_device_env()  # one CPU device, as a user's process
    sets = [f"model={model_file}", "steps=3", "batch_size=2", "seq_len=32", "params=nvme", "optimizer=nvme",
            "gradients=nvme", "activations=nvme", f"nvme_path={tmp_path / name}", f"log={log}", "lr=1e-3",
            "memory_limit=1500MiB"]  # the same budget, and so the same buffers and read-ahead, for both runs
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", "train", "--quiet",
                          *[a for s in sets for a in ("--set", s)]], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    data = json.loads(log.read_text())
    steps = data["steps"]
    state = 12 * sum(int(np.prod(s)) for s in _shapes(model))
    return {"peak": max(data["init_peak_rss_bytes"], *(s["peak_rss_bytes"] for s in steps)), "state": state,
            "losses": [s["loss"] for s in steps], "read": steps[-1]["read_bytes_nvme"]}


def _shapes(model: ModelConfig):
    import jax

    from zinfjax.models import build
    from zinfjax.models.stacked import lm_init

    return [x.shape for x in jax.tree.leaves(jax.eval_shape(lm_init(build(model)), jax.random.key(0)))]


def assert_flat(small: dict, large: dict, what: str) -> None:
    assert large["state"] > 1.5 * small["state"]
    # The state added would alone add more than 10% of the peak if it were held in memory.
    assert large["state"] - small["state"] > 0.1 * small["peak"]
    assert large["read"] > 1.5 * small["read"]  # the state really streamed
    for run in (small, large):
        assert all(np.isfinite(run["losses"])) and run["losses"][-1] < run["losses"][0]
    growth = large["peak"] / small["peak"] - 1
    assert growth < 0.10, f"peak RSS grew {growth:.1%} when {what}: {small} -> {large}"


@pytest.mark.slow
@pytest.mark.slow
def test_peak_rss_does_not_grow_with_layers_when_state_is_on_nvme(tmp_path):
    base = ModelConfig.named("gpt2-mini").replace(vocab_size=256, **WIDE)
    assert_flat(train(base.replace(n_layers=16), tmp_path, "l16"), train(base.replace(n_layers=32), tmp_path, "l32"),
                "doubling the layers")


@pytest.mark.slow
@pytest.mark.wide
def test_peak_rss_does_not_grow_with_the_vocabulary_when_state_is_on_nvme(tmp_path):
    """The embedding and tied head stream in row chunks of one size (3 MiB), so a larger vocabulary is more chunks."""
    base = ModelConfig.named("gpt2-mini").replace(n_layers=2, **WIDE)
    small, large = base.replace(vocab_size=32768, vocab_chunks=16), base.replace(vocab_size=65536, vocab_chunks=32)
    assert_flat(train(small, tmp_path, "v32k"), train(large, tmp_path, "v64k"), "doubling the vocabulary")


def test_the_heap_is_kept_lean_only_when_memory_is_capped():
    """Capped (memory_limit, host_buffer_bytes, a cgroup): freed buffers leave the heap; uncapped, they are reused."""
    def plan(source):
        return Budget(1 << 30, source, 0, 2, 1 << 26, 1 << 26)

    available, cgroup = plan("available memory less a 1.8 GiB margin"), plan("the memory cgroup's limit less a margin")
    assert not memory_capped(Memory(), available)
    assert memory_capped(Memory(), cgroup)
    assert memory_capped(Memory(host_buffer_bytes=64 << 20), available)
    assert memory_capped(Memory(memory_limit=2 << 30), available)



def test_a_closed_engine_leaves_its_compiled_functions_to_the_collector(tmp_path):
    """Once its engine is closed and the layout cache lets go, nothing keeps an engine's compiled functions.

    ``functools.cache`` on the stage and unit methods once kept every instance, and every executable,
    for the life of the process: 55 MB a gpt2-tiny engine on 8 devices, 18 GB in one test worker.
    """
    from tests.support.engine_helpers import batches, config, make_engine
    from zinfjax.engine import compiled, update_plan

    c = config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path), stage=3)
    engine = make_engine(c)
    engine.train_step(next(batches(c)))
    held = {name: weakref.ref(getattr(engine, name)) for name in ("stage_fns", "update_plan", "units")}
    engine.close()
    del engine
    compiled.cache_clear()
    update_plan.cache_clear()
    gc.collect()
    assert [name for name, ref in held.items() if ref() is not None] == []


def test_a_roomy_budget_gives_the_heap_its_room_before_read_ahead_depth_3():
    """Past depth 2, the heap's room (its kept free pages and an operation's fragments) comes before depth 3; a budget
    without it returns freed pages (`keeps_heap` false), and so does one whose explicit depth takes the room."""
    mib, read, write, base = 1 << 20, 90 << 20, 85 << 20, 300 << 20
    least = minimum_bytes(base, 0, read, write)
    depth2 = least + 2 * write + LIVE_PER_DEPTH * read  # the least roomy budget: read-ahead depth 2

    def budget(extra: int, **keys):
        return make_budget(Memory(memory_limit=depth2 + extra, **keys), read, write, baseline=base)

    assert (budget(-mib).lean, budget(-mib).keeps_heap) == (True, False)
    tight = budget(heap_room(read) - mib)  # room for depth 3 (2x the reads), not for the heap
    assert (tight.lean, tight.prefetch_depth, tight.keeps_heap) == (False, 3, False)
    room = budget(heap_room(read))
    assert (room.prefetch_depth, room.keeps_heap) == (2, True)
    both = budget(heap_room(read) + LIVE_PER_DEPTH * read)
    assert (both.prefetch_depth, both.keeps_heap) == (3, True)
    assert not budget(heap_room(read), prefetch_depth=3).keeps_heap  # the depth asked for takes the room
    # State held whole in memory leaves holes among its buffers: the room grows with it.
    resident = 4 << 30
    held = make_budget(Memory(memory_limit=depth2 + resident + heap_room(read)), read, write, resident, base)
    assert not held.keeps_heap and heap_room(read, resident) - heap_room(read) == int(HEAP_RESIDENT_FRACTION * resident)
    assert make_budget(Memory(memory_limit=depth2 + resident + heap_room(read, resident)), read, write, resident,
                       base).keeps_heap


@pytest.mark.parametrize("tuned", [True, False])
def test_a_capped_engine_keeps_the_heap_only_when_tuned_first_and_the_budget_has_room(tmp_path, monkeypatch, tuned):
    """A heap tuned after threads had each taken an arena keeps pages in every arena: the engine returns them then."""
    monkeypatch.setattr(allocator, "_tuned", tuned)
    limit = rss.current_bytes() + (2 << 30)  # roomy, with room for the heap, above what this test process holds
    c = config(params="nvme", optimizer="nvme", nvme_path=str(tmp_path / "nv"), memory_limit=limit)
    engine = make_engine(c)
    try:
        assert engine.capped and engine.budget.keeps_heap
        assert engine.strict_heap is not tuned
        assert allocator.tuned() is tuned  # the engine's own late lowering does not count as tuned first
    finally:
        engine.close()
