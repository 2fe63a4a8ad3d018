"""The step trace: compute, reads and writes of every layer, on their own tracks, as JSON and PNG."""

import collections
import json
import math
import time
import types

import pytest

from tests.support.engine_helpers import batches, config, make_engine
from zinfjax.engine.trace import Tracer, assign_rows, png_path_for

STEPS = 2


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A traced run of the engine with every tier on NVMe: (tracer, number of layers, metrics, path, detached)."""
    path = tmp_path_factory.mktemp("trace")
    c = config(params="nvme", optimizer="nvme", activations="nvme", recompute="always", nvme_path=str(path / "state"))
    engine = make_engine(c)
    tracer = Tracer(max_steps=STEPS)
    try:
        data = batches(c)
        engine.train_step(next(data))  # compiles outside the trace
        tracer.attach(engine)
        metrics = [engine.train_step(next(data)) for _ in range(STEPS + 1)]  # the last is past max_steps
        tracer.detach()
        detached = _one_step_attached_then_one_detached(engine, data)
    finally:
        engine.close()
    return tracer, engine.num_layers, metrics, path, detached


def _one_step_attached_then_one_detached(engine, data) -> types.SimpleNamespace:
    """A tracer without a step limit (only detach() stops it): what it holds after a step it was attached for,
    and after a step that follows its detach()."""
    tracer = Tracer()
    tracer.attach(engine)
    engine.train_step(next(data))
    tracer.detach()
    detached_at = time.perf_counter()
    before = tracer.events
    steps_before = tracer.steps
    metrics = engine.train_step(next(data))
    return types.SimpleNamespace(tracer=tracer, detached_at=detached_at, before=before, steps_before=steps_before,
                                 after=tracer.events, metrics=metrics)


def _layers(events, kind, track, name=None):
    return sorted({e.layer for e in events if e.kind == kind and e.track == track and name in (None, e.name)})


def test_every_layer_has_its_compute_reads_and_writes(traced):
    tracer, L, *_ = traced
    events = tracer.events
    every = list(range(L))
    for name in ("blocks_fwd", "blocks_bwd", "update_blocks"):
        assert _layers(events, "compute", "compute", name) == every
    for track in ("read params_blocks", "read opt_blocks", "read acts_blocks"):
        assert _layers(events, "read", track) == every
    for track in ("write params_blocks", "write opt_blocks", "write acts_blocks"):
        assert _layers(events, "write", track) == every
    assert len([e for e in events if e.kind == "step"]) == STEPS  # max_steps stops the recording
    assert len([e for e in events if e.name == "blocks_fwd"]) == STEPS * L
    assert all(e.end >= e.start for e in events)


def test_compute_does_not_overlap_itself_and_reads_run_ahead_of_it(traced):
    tracer, L, *_ = traced
    compute = [e for e in tracer.events if e.kind == "compute"]
    assert all(a.end <= b.start for a, b in zip(compute, compute[1:], strict=False))
    last = max(e.start for e in tracer.events if e.kind == "step")
    fwd = {e.layer: e for e in compute if e.name == "blocks_fwd" and e.start >= last}
    reads = [e for e in tracer.events if e.track == "read params_blocks" and e.start >= last]
    first_read = {e.layer: e for e in reversed(reads)}  # the forward read; backward reads come later
    # Prefetch: the read of layer i+1 is issued before the compute of layer i has finished.
    assert all(first_read[i + 1].start < fwd[i].end for i in range(L - 1))


def test_trace_json_has_one_named_thread_per_row(traced):
    tracer, _, _, path, _ = traced
    json_path, png_path = tracer.save(str(path / "trace.json"))
    assert png_path == png_path_for(json_path) == str(path / "trace.png")
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(json_path) as f:
        trace = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(set(names.values())) == len(names) == len(assign_rows(tracer.events))
    assert {"compute", "read params_blocks", "write opt_blocks", "step"} <= set(names.values())
    bars = [e for e in trace if e["ph"] == "X"]
    assert len(bars) == len(tracer.events)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["tid"] in names for e in bars)
    for tid in names:  # bars of one thread never overlap, so Perfetto draws each one
        row = sorted((e["ts"], e["ts"] + e["dur"]) for e in bars if e["tid"] == tid)
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(row, row[1:], strict=False))


def test_detach_leaves_the_engine_untraced(traced):
    tracer, L, metrics, _, detached = traced
    kinds = lambda events: collections.Counter(e.kind for e in events)  # noqa: E731
    # attached, the step is recorded: its bar, every layer's compute, its reads and its writes
    before = kinds(detached.before)
    assert detached.steps_before == before["step"] == 1
    assert before["compute"] >= 3 * L and before["read"] > 0 and before["write"] > 0
    # detached, the next step (it ran: it has its metrics) records nothing: the step count and the step and
    # compute bars stay as they were, and no bar of any kind begins after detach(). (A read or write bar of the
    # attached step may show up late, once its I/O thread stamps its end, so those are told apart by their start.)
    assert math.isfinite(detached.metrics["loss"]) and detached.metrics["write_bytes_nvme"] > 0
    after = kinds(detached.after)
    assert (detached.tracer.steps, after["step"], after["compute"]) == (1, 1, before["compute"]), (
        f"after detach() the tracer counts {detached.tracer.steps} steps, {after['step']} step bars and "
        f"{after['compute']} compute bars (before it: 1, 1 and {before['compute']})")
    late = [e for e in detached.after if e.start >= detached.detached_at]
    assert not late, f"{len(late)} events recorded after detach(), e.g. {late[:3]}"
    for m in metrics:
        assert {"loss", "stall_s", "compute_s", "overlap", "read_bytes_nvme", "write_bytes_nvme"} <= set(m)
        assert 0.0 <= m["overlap"] <= 1.0
