"""A timeline of training steps: compute, every read and every write, per layer, on their own tracks.

`Tracer` records what the engine does without slowing its hot path:

- **compute**: the engine tells the tracer when it dispatched each jitted layer function and
  hands it the (not yet computed) output. A watcher thread waits for the outputs in dispatch
  order and stamps their completion. One stream runs the functions in that order, so a layer's
  compute starts at ``max(its dispatch, the previous layer's completion)``;
- **reads**: the read-ahead's own events (issue to data on the device), one track per store;
- **writes**: issue to completion of each ``store.write`` future, one track per store;
- **steps**: one bar per training step.

`save` writes Chrome/Perfetto trace JSON (open it at https://ui.perfetto.dev or
chrome://tracing) and a PNG timeline drawn from the same events, next to it
(``trace.json`` -> ``trace.png``). Reads of layers ``i+1..i+k`` drawn under the compute of
layer ``i`` are the prefetch overlap.

Example:
    >>> import jax, jax.numpy as jnp, optax, tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.engine import Engine, TreeSource, update_plan
    >>> from zinfjax.program import program_for
    >>> from zinfjax.sharding import make_mesh
    >>> def loss_fn(params, batch):                     # three layers: a scan over their stacked weights
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
    ...     return jnp.mean(h ** 2)
    >>> params, batch, tx = {"blocks": jnp.ones((3, 8, 8)) / 8}, jnp.ones((8, 8)), optax.sgd(0.1)
    >>> program = program_for(loss_fn, params, batch)
    >>> engine = Engine(program, TreeSource(program, update_plan(tx, program), params), tx,
    ...                 Config(params="nvme", nvme_path=tempfile.mkdtemp()).engine_settings(), make_mesh({"data": 1}))
    >>> tracer = Tracer(max_steps=3).attach(engine)
    >>> for _ in range(5):
    ...     metrics = engine.train_step(batch)
    >>> tracer.detach()
    >>> json_path, png_path = tracer.save(f"{tempfile.mkdtemp()}/trace.json")
    >>> os.path.basename(png_path), len([e for e in tracer.events if e.kind == "step"])   # the first 3 steps
    ('trace.png', 3)
    >>> engine.close()
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
from collections.abc import Iterable

import jax

from zinfjax.engine.readahead import ReadEvent


@dataclasses.dataclass
class TraceEvent:
    """One bar of the timeline (``time.perf_counter`` seconds).

    Attributes:
        kind: "step", "compute", "read" or "write".
        track: the row it is drawn on, e.g. "compute", "read params_blocks".
        name: what it was, e.g. "block_fwd".
        layer: the layer index (0 for embed, head and steps).
        start: when it started.
        end: when it ended (None while in flight).
    """

    kind: str
    track: str
    name: str
    layer: int
    start: float
    end: float | None = None


class Tracer:
    """Records the timeline of an engine's steps; see the module docstring.

    Args:
        max_steps: record at most this many steps (None: every step), so a long run can keep
            the tracer attached without its events growing without bound.

    Example:
        >>> import jax, jax.numpy as jnp, optax, tempfile
        >>> from zinfjax import Config
        >>> from zinfjax.engine import Engine, TreeSource, update_plan
        >>> from zinfjax.program import program_for
        >>> from zinfjax.sharding import make_mesh
        >>> def loss_fn(params, batch):                     # three layers: a scan over their stacked weights
        ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
        ...     return jnp.mean(h ** 2)
        >>> params, batch, tx = {"blocks": jnp.ones((3, 8, 8)) / 8}, jnp.ones((8, 8)), optax.sgd(0.1)
        >>> program = program_for(loss_fn, params, batch)
        >>> settings = Config(params="nvme", nvme_path=tempfile.mkdtemp()).engine_settings()
        >>> engine = Engine(program, TreeSource(program, update_plan(tx, program), params), tx, settings,
        ...                 make_mesh({"data": 1}))
        >>> tracer = Tracer(max_steps=2).attach(engine)
        >>> metrics = engine.train_step(batch)
        >>> tracer.detach()
        >>> sorted({e.kind for e in tracer.events}), sorted({e.track for e in tracer.events if e.kind == "read"})
        (['compute', 'read', 'step', 'write'], ['read params_blocks'])
        >>> engine.close()
    """

    def __init__(self, max_steps: int | None = None):
        self.max_steps = max_steps
        self.steps = 0
        self.recording = False
        self._events: list[TraceEvent] = []
        self._reads: list[ReadEvent] = []
        self._pending: queue.Queue = queue.Queue()
        self._watcher: threading.Thread | None = None
        self._engine = None
        self._last_compute_end = float("-inf")

    # ---- attaching ----------------------------------------------------------------------------

    def attach(self, engine) -> Tracer:
        """Starts recording ``engine``'s steps; returns the tracer."""
        if self._engine is not None:
            raise RuntimeError("this Tracer is already attached to an engine; detach() it first")
        self._engine = engine
        self._watcher = threading.Thread(target=self._watch, name="zinf-trace", daemon=True)
        self._watcher.start()
        engine.tracer = self
        return self

    def detach(self) -> None:
        """Stops recording and waits for the compute still in flight to be stamped; idempotent."""
        if self._engine is None:
            return
        self._engine.tracer = None
        self._engine = None
        self._pending.put(None)
        self._watcher.join()
        self._watcher = None

    # ---- hooks the engine calls --------------------------------------------------------------

    def step_begin(self) -> None:
        self.recording = self.max_steps is None or self.steps < self.max_steps

    def step_end(self, start: float, end: float) -> None:
        if self.recording:
            self._events.append(TraceEvent("step", "step", f"step {self.steps}", self.steps, start, end))
            self.steps += 1
        self.recording = False

    def compute(self, name: str, layer: int, dispatch_t: float, out) -> None:
        """One jitted call dispatched at ``dispatch_t``; ``out`` is its (asynchronous) result."""
        if self.recording:
            self._pending.put((name, layer, dispatch_t, out))

    def write(self, track: str, layer: int, issue_t: float, future) -> None:
        """One ``store.write`` issued at ``issue_t``; its future completes when the layer is stored."""
        if not self.recording:
            return
        event = TraceEvent("write", f"write {track}", track, layer, issue_t)
        self._events.append(event)
        future.add_done_callback(lambda _: setattr(event, "end", time.perf_counter()))

    def reads(self, events: Iterable[ReadEvent]) -> None:
        """The read-ahead's events of one schedule."""
        if self.recording:
            self._reads.extend(events)

    # ---- results ------------------------------------------------------------------------------

    @property
    def events(self) -> list[TraceEvent]:
        """Every finished event so far, in start order (drains the compute watcher first)."""
        if self._watcher is not None:
            self._drain()
        reads = [TraceEvent("read", f"read {e.track}", e.track, e.layer, e.issue_t, e.complete_t)
                 for e in self._reads]
        done = [e for e in self._events + reads if e.end is not None]
        return sorted(done, key=lambda e: e.start)

    def save(self, path: str) -> tuple[str, str]:
        """Writes the trace JSON at ``path`` and its PNG timeline next to it; returns both paths."""
        return write_trace(self.events, path)

    # ---- the watcher --------------------------------------------------------------------------

    def _drain(self) -> None:
        done = threading.Event()
        self._pending.put(done)
        done.wait()

    def _watch(self) -> None:
        while True:
            item = self._pending.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            self._stamp(*item)

    def _stamp(self, name: str, layer: int, dispatch_t: float, out) -> None:
        try:
            jax.block_until_ready(out)
        except Exception:  # noqa: BLE001 - a failed or deleted output still ends the bar
            pass
        end = time.perf_counter()
        start = max(dispatch_t, self._last_compute_end)
        self._last_compute_end = end
        self._events.append(TraceEvent("compute", "compute", name, layer, start, end))


# ---- writing ---------------------------------------------------------------------------------

_TRACK_ORDER = {"step": 0, "compute": 1, "read": 2, "write": 3}


def assign_rows(events: list[TraceEvent]) -> list[tuple[str, list[TraceEvent]]]:
    """Rows of the timeline: one per track, split into lanes where its events overlap in time.

    Perfetto and the PNG both need the bars of one row not to overlap; reads kept in flight
    together (prefetch depth > 1) go to lanes "read params_blocks", "read params_blocks #2", ...

    Example:
        >>> events = [TraceEvent("step", "step", "step 1", 0, 0.0, 1.0),
        ...           TraceEvent("compute", "compute", "block_fwd", 0, 0.2, 0.5),
        ...           TraceEvent("read", "read params", "read", 1, 0.1, 0.6),     # layers 1 and 2 read at once
        ...           TraceEvent("read", "read params", "read", 2, 0.3, 0.8)]
        >>> [name for name, _ in assign_rows(events)]
        ['step', 'compute', 'read params', 'read params #2']
    """
    tracks: dict[str, list[TraceEvent]] = {}
    for e in sorted(events, key=lambda e: (e.start, e.end)):
        tracks.setdefault(e.track, []).append(e)
    rows = []
    for track in sorted(tracks, key=lambda t: (_TRACK_ORDER.get(tracks[t][0].kind, 9), t)):
        lanes: list[list[TraceEvent]] = []
        for e in tracks[track]:
            lane = next((ln for ln in lanes if ln[-1].end <= e.start), None)
            if lane is None:
                lanes.append(lane := [])
            lane.append(e)
        rows += [(track if k == 0 else f"{track} #{k + 1}", lane) for k, lane in enumerate(lanes)]
    return rows


def chrome_trace(events: list[TraceEvent]) -> dict:
    """The events as Chrome trace JSON: "X" events in microseconds, one thread per row.

    Example:
        >>> events = [TraceEvent("step", "step", "step 1", 0, 0.0, 1.0),
        ...           TraceEvent("compute", "compute", "block_fwd", 0, 0.2, 0.5),
        ...           TraceEvent("read", "read params", "read", 1, 0.1, 0.6),     # layers 1 and 2 read at once
        ...           TraceEvent("read", "read params", "read", 2, 0.3, 0.8)]
        >>> trace = chrome_trace(events)
        >>> [(e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"][:2]
        [('step 1', 0.0, 1000000.0), ('block_fwd 0', 200000.0, 300000.0)]
    """
    origin = min((e.start for e in events), default=0.0)
    out = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "zinfjax"}}]
    for tid, (row, lane) in enumerate(assign_rows(events), start=1):
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": row}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        out += [{
            "ph": "X", "name": f"{e.name} {e.layer}" if e.kind != "step" else e.name, "cat": e.kind,
            "pid": 1, "tid": tid, "ts": (e.start - origin) * 1e6, "dur": (e.end - e.start) * 1e6,
            "args": {"layer": e.layer, "track": e.track},
        } for e in lane]
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def png_path_for(path: str) -> str:
    """Where the PNG of a trace goes: ``trace.json`` -> ``trace.png``."""
    root, ext = os.path.splitext(path)
    return (root if ext == ".json" else path) + ".png"


def write_trace(events: list[TraceEvent], path: str) -> tuple[str, str]:
    """Writes the Chrome trace JSON at ``path`` and the PNG timeline next to it.

    Example:
        >>> import tempfile
        >>> events = [TraceEvent("step", "step", "step 1", 0, 0.0, 1.0),
        ...           TraceEvent("read", "read params", "read", 1, 0.1, 0.6)]
        >>> runs = tempfile.mkdtemp()
        >>> write_trace(events, f"{runs}/trace.json") == (f"{runs}/trace.json", f"{runs}/trace.png")
        True
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f)
    png = png_path_for(path)
    draw_timeline(events, png)
    return path, png


# ---- drawing ---------------------------------------------------------------------------------

_COMPUTE_COLORS = {"fwd": "tab:green", "bwd": "tab:blue", "update": "tab:purple"}
_KIND_COLORS = {"step": "0.75", "read": "tab:orange", "write": "tab:red"}


def _color(e: TraceEvent) -> str:
    if e.kind != "compute":
        return _KIND_COLORS[e.kind]
    kind = "update" if e.name.startswith("update") else e.name.rsplit("_", 1)[-1]
    return _COMPUTE_COLORS.get(kind, "tab:cyan")


def draw_timeline(events: list[TraceEvent], path: str, title: str | None = None) -> str:
    """A PNG of the timeline: one row per track (lane), a bar per event; returns ``path``.

    Example:
        >>> import tempfile
        >>> events = [TraceEvent("step", "step", "step 1", 0, 0.0, 1.0),
        ...           TraceEvent("read", "read params", "read", 1, 0.1, 0.6)]
        >>> png = f"{tempfile.mkdtemp()}/trace.png"
        >>> draw_timeline(events, png) == png and os.path.getsize(png) > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = assign_rows(events)
    origin = min((e.start for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.28 * len(rows)), dpi=110)
    for y, (_, lane) in enumerate(rows):
        bars = [(e.start - origin, max(e.end - e.start, 1e-5)) for e in lane]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=[_color(e) for e in lane],
                       edgecolor="black", linewidth=0.2)
    for e in events:
        if e.kind == "step":
            ax.axvline(e.start - origin, color="0.4", linestyle=":", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=c, label=n) for n, c in [
        ("forward", "tab:green"), ("head fwd+bwd", "tab:olive"), ("backward", "tab:blue"),
        ("optimizer update", "tab:purple"), ("read", "tab:orange"), ("write", "tab:red")]]
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncol=6)
    ax.set_title(title or "zinfjax step timeline: compute, reads and writes per layer", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
