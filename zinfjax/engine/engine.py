"""`Engine`: a wrapped state's stores opened and filled, its training steps run, its state gathered back.

An engine plans its memory before any store opens (`zinfjax.engine.engine_plan`), writes the initial
state into the stores unit by unit, and runs each step (`zinfjax.engine._step`) over them, its
computations and writes bounded behind it (`WriteBehind`) and its reads ahead of it (`ReadAhead`).

ZeRO stages 0-3 and tensor parallelism are sharding rules (`Placement`, zinfjax/sharding.py): every
store holds its leaves in their kind's layout, the stage functions gather parameters and scatter
gradients inside their jitted bodies, and each update runs on the optimizer state's shards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.engine import crash_marker, reuse
from zinfjax.engine._step import Step
from zinfjax.engine._step_io import StepIO
from zinfjax.engine.budget import LIVE_BASE, NVME_MMAP_THRESHOLD, MemoryBudgetError, memory_capped
from zinfjax.engine.compile_cache import Compiled, compiled
from zinfjax.engine.engine_plan import EnginePlan, PlanInputs, plan_engine, update_location
from zinfjax.engine.in_place import in_place_leaves
from zinfjax.engine.loss_scale import LossScale
from zinfjax.engine.parts import fill_parts
from zinfjax.engine.readahead import ReadAhead
from zinfjax.engine.stores import (
    build_stores,
    split_advice,
    spools_gradients,
    store_specs,
    tied_groups,
    written_alone,
)
from zinfjax.engine.telemetry import StepTelemetry
from zinfjax.engine.writebehind import WriteBehind
from zinfjax.errors import UserError
from zinfjax.program.residuals import residual_bytes
from zinfjax.program.split import Program, unslice
from zinfjax.runtime import allocator
from zinfjax.sections import EngineSettings
from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules
from zinfjax.store.layout import host_tier_kind


class BatchError(UserError):
    """A batch that does not match what the state was wrapped for."""


class Prepared(NamedTuple):
    """What an engine settles before it opens a store: its layout, its stores' specs and its plan (`prepare`). These
    are derived from the settings, which keep what the user gave (``update_on=auto`` stays auto there)."""

    compute_dtype: object
    rules: ShardingRules
    platform: str  # the compute devices' platform: "cpu", "gpu", "tpu"
    update_on: str  # where the update runs: "device" or "host" (`update_location`)
    host_kind: str
    host_kind_fallback: str | None
    layout: Compiled
    spools_gradients: bool
    specs: list
    acts: dict
    residual_bytes: int
    planned: EnginePlan


def prepare(program: Program, tx, settings: EngineSettings, mesh: Mesh, tp_rules: tuple = (),
            threshold: int = PERSISTENCE_THRESHOLD) -> Prepared:
    """Everything an `Engine` decides before it opens a store: raises where the engine would (a memory budget
    that cannot train the program, a micro-batch that does not split), and opens nothing."""
    tiering, numerics = settings.tiering, settings.numerics
    compute_dtype = COMPUTE_DTYPES[numerics.precision]
    rules = ShardingRules.for_mesh(mesh, tiering.stage, tp_rules, threshold)
    platform = mesh.devices.flat[0].platform
    update_on = update_location(tiering, platform)
    on_host = update_on == "host"
    host_kind, fallback = host_tier_kind(mesh.devices.flat[0], on_host)
    params_kind = host_kind if on_host and tiering.params != "device" else "device"
    layout = compiled(program, tx, rules, mesh, compute_dtype, numerics.grad_accum, on_host, params_kind, host_kind)
    _check_micro_batch(program, mesh)
    spools = spools_gradients(numerics, layout.plan)
    specs, acts = store_specs(tiering, numerics, program, layout.plan, layout.placement, compute_dtype)
    # What this process's devices hold of one step's saved residuals, at most: the batch's rows split over data.
    residuals = residual_bytes(program, numerics.grad_accum) * len(mesh.local_devices) // mesh.shape["data"]
    try:
        planned = plan_engine(PlanInputs(settings.memory, program, layout.plan, specs, list(acts.values()), platform,
                                         residuals, spools, on_host))
    except MemoryBudgetError as e:
        advice = split_advice(tiering, specs + list(acts.values()), e.short)
        if not advice:
            raise
        raise MemoryBudgetError.short_by(e.short, f"{e}; {advice}") from None
    return Prepared(compute_dtype, rules, platform, update_on, host_kind, fallback, layout, spools, specs, acts,
                    residuals, planned)


def streamed_program(make: Callable[[bool], Program], tx, settings: EngineSettings, mesh: Mesh,
                     tp_rules: tuple = ()) -> Program:
    """The program an engine streams: ``make(nest_tiles)`` (`zinfjax.program.split.program_for`), its tile scans cut
    again (`zinfjax.program.nested`) only where the layer must be streamed tile by tile.

    Streaming a layer tile by tile reads, writes and updates it in ``tiles`` times as many operations, each with
    its own dispatch, files and checksums (docs/engine.md, "Tiles"). So with ``stream_tiles=auto`` a layer whose
    body scans over tiles is streamed whole, its tiles computed in turn inside the layer's operation, whenever
    the memory budget holds that operation (`prepare` accepts it), and tile by tile only when it does not;
    ``stream_tiles=always`` streams it tile by tile regardless. A program without tile scans is the same either way.

    Example (GPT-2 blocks whose MLP and attention scan over 2 tiles each):
        >>> import jax, jax.numpy as jnp, optax
        >>> from zinfjax import models
        >>> from zinfjax.models.stacked import lm_init, lm_loss
        >>> from zinfjax.program import program_for
        >>> from zinfjax.sections import Memory
        >>> from zinfjax.sharding import make_mesh
        >>> model = models.build(models.ModelConfig.named("gpt2-tiny").replace(tiles=2))
        >>> like, batch = jax.eval_shape(lm_init(model), jax.random.key(0)), jax.ShapeDtypeStruct((8, 17), jnp.int32)
        >>> make = lambda nest: program_for(lm_loss(model), like, batch, nest_tiles=nest)
        >>> tx, mesh = optax.adamw(1e-3), make_mesh({"data": 1})
        >>> [g.name for g in streamed_program(make, tx, EngineSettings(), mesh).streamed_groups()]  # a layer fits
        ['s:embed.wte.embedding', 's:blocks']
        >>> always = EngineSettings(memory=Memory(stream_tiles="always"))
        >>> [g.name for g in streamed_program(make, tx, always, mesh).streamed_groups()]
        ['s:embed.wte.embedding', 's:blocks.layer', 's:blocks.tiles1', 's:blocks.tiles3']
    """
    nested = make(True)
    if settings.memory.stream_tiles == "always" or all(stage.body is None for stage in nested.scans()):
        return nested
    whole = make(False)
    try:
        prepare(whole, tx, settings, mesh, tp_rules)
    except MemoryBudgetError:
        return nested
    return whole


def _check_micro_batch(program: Program, mesh: Mesh) -> None:
    data = mesh.shape["data"]
    rows = {np.shape(x)[0] for x in program.batch_like if np.ndim(x)}
    bad = [r for r in rows if r % data]
    if bad:
        raise BatchError(f"a micro-batch of {bad[0]} rows does not split over the {data} devices of the data "
                         f"axis; make batch_size / grad_accum a multiple of {data}")


class Engine:
    """Trains a `Program` with its state on the tiers of ``settings`` (`Config.engine_settings`).

    ``source`` gives the initial state unit by unit (`zinfjax.engine.source`). ``settings.tiering.stage``
    shards the state over the mesh axis ``data``; a ``model`` axis splits it by ``tp_rules``. The settings are
    kept as given; what the engine derives from them is its own (`update_on`, `budget`, the plan's parts).

    Example:
        >>> import jax, jax.numpy as jnp, tempfile
        >>> from zinfjax.engine import TreeSource, update_plan
        >>> from zinfjax.program import program_for
        >>> from zinfjax.sharding import make_mesh
        >>> def loss_fn(params, batch):                     # three layers: a scan over their stacked weights
        ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
        ...     return jnp.mean(h ** 2)
        >>> params, batch, tx = {"blocks": jnp.ones((3, 8, 8)) / 8}, jnp.ones((8, 8)), optax.adamw(1e-3)
        >>> program = program_for(loss_fn, params, batch)
        >>> from zinfjax.sections import Tiering
        >>> settings = EngineSettings(tiering=Tiering(params="nvme", optimizer="nvme", nvme_path=tempfile.mkdtemp()))
        >>> engine = Engine(program, TreeSource(program, update_plan(tx, program), params), tx, settings,
        ...                 make_mesh({"data": 1}))
        >>> metrics = engine.train_step(batch)
        >>> engine.step_count, metrics["read_bytes_nvme"] > 0, engine.params()["blocks"].shape
        (1, True, (3, 8, 8))
        >>> engine.close()
    """

    def __init__(self, program: Program, source, tx: optax.GradientTransformation, settings: EngineSettings,
                 mesh: Mesh, tp_rules: tuple = (), threshold: int = PERSISTENCE_THRESHOLD):
        self.program, self.settings, self.mesh, self.tx = program, settings, mesh, tx
        ready = prepare(program, tx, settings, mesh, tp_rules, threshold)
        self.compute_dtype, self.rules, self.platform = ready.compute_dtype, ready.rules, ready.platform
        self.update_on, self.on_host = ready.update_on, ready.update_on == "host"
        # The host tier's memory kind, and why it is not pinned_host (recorded in the log): `host_tier_kind`.
        self.host_kind, self.host_kind_fallback = ready.host_kind, ready.host_kind_fallback
        self.placement, self.stage_fns = ready.layout.placement, ready.layout.stage_fns
        self.update_plan, self.units = ready.layout.plan, ready.layout.units
        self.loss_scale = LossScale(settings.numerics.precision == "fp16")
        self.spools_gradients = ready.spools_gradients
        self.micro = settings.numerics.grad_accum
        # The streamed groups other scans stream too, whose later scans spool a share of the gradient (none for a
        # frozen group: no update takes it).
        self._tied = {g: n for g, n in tied_groups(program).items() if not ready.layout.plan.frozen_group(g)}
        specs, acts, planned = ready.specs, ready.acts, ready.planned
        self.planned_needs = planned.needs  # the (read, write, resident) bytes the budget was planned for
        self.residual_bytes = ready.residual_bytes
        self.parts, self.budget, self.saves_residuals = planned.parts, planned.budget, planned.saves_residuals
        self.reuse = planned.reuse
        self.handoff = planned.handoff  # not "carry": that is a scan's loop carry
        self.handed_over = reuse.Held()  # the compute copies the last step's updates handed to the next forward
        # While the state is written at the start, no step holds its operations' memory: writes may use it while
        # memory is plentiful. Under a cap, computing the state takes it: the writes keep the step's own bound.
        self.capped = settings.tiering.uses_nvme and memory_capped(settings.memory, self.budget)
        fill_bound = self.budget.write_bytes_in_flight + (0 if self.capped else LIVE_BASE * planned.needs[0])
        # A capped budget without room for the freed pages the heap keeps (`zinfjax.engine.budget.heap_room`) gives
        # them back at once (docs/design.md, invariant 2); one with room keeps them, as an uncapped run does.
        self.strict_heap = self.capped and not (self.budget.keeps_heap and allocator.tuned())
        if self.strict_heap:
            allocator.tune_allocator(mmap_threshold=NVME_MMAP_THRESHOLD, trim_threshold=allocator.GLIBC_TRIM_THRESHOLD,
                                     late=True)
        # The step-in-progress marker's directory: the run's nvme_path where state is on NVMe (`crash_marker`).
        self._marker = settings.tiering.nvme_path if settings.tiering.uses_nvme else None
        self.step_count = int(source.step)
        self.tracer = None  # a zinfjax.engine.trace.Tracer while one is attached
        self._behind = WriteBehind(fill_bound, self.budget.prefetch_depth)  # the computations and writes in flight
        self._telemetry: StepTelemetry | None = None
        self._steps_run = 0
        # A fine-tune's frozen base, read from a checkpoint: its leaves stay there (read in place where its chunks
        # are the store's, `zinfjax.engine.in_place`), and the run's checkpoints name it instead of saving them.
        held = source.base_leaves() if hasattr(source, "base_leaves") else frozenset()
        self.base_leaves = frozenset(held & self.update_plan.frozen)
        self.base = source.base if self.base_leaves else None
        self.in_place = in_place_leaves(settings.tiering.params, program, source, self.base_leaves, self.placement,
                                        self.compute_dtype)
        alone = written_alone(program, self.update_plan, self.spools_gradients, self.platform)
        # Read arrays used again hold what reads freed until the next read takes them: room a budget that gives
        # its pages back does not have (llama-1b at 4 GiB was killed by its cgroup so).
        self.stores = build_stores(settings.tiering, self.budget.host_buffer_bytes, specs, acts, self.parts,
                                   self.host_kind, self.in_place, alone, reuse_reads=not self.strict_heap)
        self.interrupted_step = crash_marker.interrupted(self._marker)
        try:
            self._fill(source)
        except BaseException:
            self.stores.close()
            raise
        self._release_scratch()

    # ---- set-up ------------------------------------------------------------------------------

    @property
    def tiles(self) -> int:
        """The tiles of the layers' tile scans (`zinfjax.program.nested`): 1 when no scan is tiled."""
        return max((leaf.stream.tiles for leaf in self.program.leaves if leaf.stream), default=0) or 1

    @property
    def largest_operation_bytes(self) -> int:
        """What the step's largest operation reads: a unit's slices of every kind and an activation checkpoint."""
        return self.planned_needs[0]

    @property
    def num_layers(self) -> int:
        """Slices of the longest streamed group (the layers of a transformer)."""
        return max((g.length for g in self.program.streamed_groups()), default=1)


    def _release_scratch(self) -> None:
        """With the state on nvme and memory capped, memory is the budget: give the compiler's freed scratch back
        to the system. Uncapped, the heap keeps it: the step reuses it, and pages trimmed out of a heap on
        transparent huge pages come back anyway, as the kernel collapses their ranges into huge pages again
        (RSS creeping up over minutes with nothing allocated: docs/BENCHMARKS.md, "Soak")."""
        if self.capped:
            allocator.trim()

    def _fill(self, source) -> None:
        """Writes the initial state into the stores, one unit at a time."""
        s = self.stores
        given = source.globals()
        self.globals = list(given) if given is not None else self.update_plan.init_globals()
        for g in self.program.groups.values():
            in_place = frozenset(self.in_place.get(g.name, ()))  # already in their store: neither read nor written
            for i in range(g.length):
                given_state = source.state(g.name, i)
                if given_state is not None:
                    order = [st.path for st in self.update_plan.state_of(g.name)]
                    given_state = dict(zip(order, given_state, strict=True))
                for part in fill_parts(self.program, self.update_plan, self.parts, g.name):
                    paths, state_paths = self.units.paths(g.name, part and part.leaves)
                    params = self._fill_source(source, g.name, i, paths, in_place)
                    compute, master, state = self.units.init(g.name, self.units.size(g.name, i), part and part.leaves)(
                        [params[p] for p in paths], self.units.start(g.name, i))
                    if given_state is not None:
                        state = [given_state[p] for p in state_paths]
                    keys = part and part.params
                    self._fill_params(g.name, i, dict(zip(paths, compute, strict=True)), keys, in_place)
                    self._fill_master(g.name, i, dict(zip(paths, master, strict=True)), keys)
                    if state_paths:
                        self._write("fill", s.opt[g.name], i, dict(zip(state_paths, state, strict=True)),
                                    part and part.state)
                    if self.capped:  # one part computing at a time: its intermediates go before the next begins
                        jax.block_until_ready((compute, master, state))
            s.flush()
        self._behind.bound = self.budget.write_bytes_in_flight
        if self.loss_scale.enabled and source.loss_scale is not None:
            self.loss_scale.scale = float(source.loss_scale)
            self.loss_scale.good = int(source.loss_scale_good)

    def _fill_source(self, source, group: str, i: int, paths: list, in_place: frozenset) -> dict:
        """The parameters ``paths`` of unit ``i`` from ``source`` (only those, one part at a time: the fill holds a
        part, not a layer); zeros stand in for those read in place, which are never written."""
        leaves = {leaf.path: leaf for leaf in self.program.leaves_of(group)}
        asked = frozenset(p for p in paths if p not in in_place)
        whole = len(paths) == len(leaves) and not in_place
        given = dict(zip(leaves, source.params(group, i) if whole else source.params(group, i, asked), strict=True))
        return {p: np.zeros(leaves[p].slice_shape, leaves[p].dtype) if p in in_place else given[p] for p in paths}

    def _fill_params(self, group: str, i: int, compute: dict, keys, in_place: frozenset) -> None:
        """Writes the compute copies of unit ``i`` but those read in place."""
        if in_place:
            compute = {p: x for p, x in compute.items() if p not in in_place}
            keys = tuple(keys or self.stores.params[group].like)
            keys = tuple(p for p in keys if p in compute)
            if not keys:
                return
        self._write("fill", self.stores.params[group], i, compute, keys)

    def _fill_master(self, group: str, i: int, master: dict, keys) -> None:
        """Writes the fp32 masters of the leaves that keep one (`zinfjax.engine.stores.masterless`)."""
        store = (self.stores.master or {}).get(group)
        if store is None:
            return
        kept = {p: x for p, x in master.items() if p in store.like}
        if kept:
            self._write("fill", store, i, kept, keys and tuple(p for p in keys if p in kept))

    # ---- the step ----------------------------------------------------------------------------

    def train_step(self, batch, rng=None) -> dict:
        """One optimizer step on ``batch`` (a pytree of arrays with a leading batch axis); returns its metrics."""
        crash_marker.begin(self._marker, self.step_count + 1)
        if self.strict_heap:  # the last step's freed buffers leave the heap before this one's peak
            allocator.trim()
        for store in self.stores.all():  # nor do the last step's read arrays wait through this one's forward
            store.drop_free_reads()
        telemetry = self._telemetry = StepTelemetry(self.stores.pieces(), self.tracer)
        try:
            io = StepIO(self._dispatch, self._write, self._tied, telemetry)
            step = Step(self, io, self._micro_batches(batch), self._keys(rng))
            reads = ReadAhead([op.reads for op in step.ops], self.budget.prefetch_depth)
            for op, results in zip(step.ops, reads, strict=True):
                op.run(results)
            telemetry.add_reads(reads)
            updated = step.updates.finish()
            skipped = updated is None
            if not skipped:
                self.globals = updated
            self._behind.forget_computations()
            loss = float(jnp.mean(step.loss))
            self.stores.flush()
        except BaseException:
            self.handed_over = reuse.Held()  # what a failed step kept may never have landed: the next one reads
            raise
        self.step_count += 0 if skipped else 1
        crash_marker.end(self._marker)
        self._telemetry = None
        if not self._steps_run:
            self._release_scratch()  # the first step compiled every stage function
        self._steps_run += 1
        return telemetry.finish(loss=loss, skipped=skipped, loss_scale=self.loss_scale.value,
                                residual_bytes=step.kept_bytes)

    def _micro_batches(self, batch) -> list:
        """The batch's leaves as ``(A, rows, ...)``: micro-batch ``k`` is rows ``k::A`` (spread over the data axis)."""
        try:
            leaves = self.program.batch_tree.flatten_up_to(batch)
        except (ValueError, TypeError) as e:
            raise BatchError(f"the batch's structure does not match the one the state was wrapped for: {e}") from e
        out = []
        for x, like in zip(leaves, self.program.batch_like, strict=True):
            x = np.asarray(x) if not isinstance(x, jax.Array) else x
            want = (like.shape[0] * self.micro, *like.shape[1:]) if like.shape else ()
            if tuple(np.shape(x)) != want or jnp.dtype(x.dtype) != jnp.dtype(like.dtype):
                raise BatchError(f"a batch leaf has {jnp.dtype(x.dtype).name}{list(np.shape(x))}; this state was "
                                 f"wrapped for {jnp.dtype(like.dtype).name}{list(want)}")
            if not like.shape:
                out.append(jnp.broadcast_to(x, (self.micro,)))
                continue
            rows = like.shape[0]
            x = jnp.asarray(x).reshape(rows, self.micro, *like.shape[1:]).swapaxes(0, 1)
            out.append(jax.device_put(x, self.placement.rows_sharding(x.shape)))
        return out

    def _keys(self, rng):
        """One key per micro-batch: the step's key (``fold_in(key(seed), step)``), folded with the micro-batch index."""
        if self.program.rng_var is None:
            return None
        key = rng if rng is not None else jax.random.fold_in(jax.random.key(self.settings.seed), self.step_count + 1)
        if self.micro == 1:
            return key[None]
        return jax.vmap(lambda a: jax.random.fold_in(key, a))(jnp.arange(self.micro))

    def _dispatch(self, name: str, layer: int, fn, *args):
        """``fn(*args)``, dispatched asynchronously; an attached tracer gets the dispatch time and the result.
        At most ``prefetch_depth`` computations (at least one) are in flight (`WriteBehind`)."""
        t0 = time.perf_counter()
        out = fn(*args)
        if self.tracer is not None:
            self.tracer.compute(name, layer, t0, out)
        self._behind.computed(out)
        return out

    def _write(self, track: str, store, i: int, tree, keys: tuple[str, ...] | None = None,
               from_host: bool = False) -> None:
        """Writes slice ``i`` (or its leaves ``keys``) to ``store``, bounding the bytes in flight (``from_host``:
        the arrays are in host memory already, as the update on the host leaves them)."""
        t0 = time.perf_counter()
        future = store.write(i, tree, keys)
        nbytes = store.part_nbytes(keys)
        if self._telemetry is not None:
            self._telemetry.add_write(store, i, keys, from_host)
        if self.tracer is not None:
            self.tracer.write(track, i, t0, future)
        self._behind.written(future, nbytes)  # the bytes in flight bounded by the memory budget (`WriteBehind`)

    # ---- reading the state back --------------------------------------------------------------

    def _gather(self, kind: str, group: str, paths: list[str]) -> dict[str, list]:
        store = self.stores.kind(kind)[group]
        slices = [store.read(i).result() for i in range(store.num_layers)]
        return {p: [s[p] for s in slices] for p in paths}

    def params(self, kind: str = "master"):
        """The whole parameter tree in the user's layout (``master``: fp32 under mixed precision), gathered."""
        flat = [None] * len(self.program.leaves)
        for g in self.program.groups.values():
            leaves = self.program.leaves_of(g.name)
            store = self.stores.kind(kind).get(g.name) if kind == "master" else None  # a frozen leaf may have none
            mastered = [leaf.path for leaf in leaves if store is not None and leaf.path in store.like]
            got = self._gather("master", g.name, mastered) if mastered else {}
            rest = [leaf.path for leaf in leaves if leaf.path not in got]
            got.update(self._gather("params", g.name, rest) if rest else {})
            for leaf in leaves:
                flat[leaf.index] = unslice(leaf, got[leaf.path])
        return jax.tree_util.tree_unflatten(self.program.params_tree, flat)

    def opt_state(self):
        """The whole optax state, gathered: what ``tx.init`` and ``tx.update`` of the whole tree would hold."""
        flat = [None] * len(self.update_plan.state)
        for s, x in zip(self.update_plan.globals, self.globals, strict=True):
            flat[s.index] = x
        for g in self.program.groups.values():
            state = self.update_plan.state_of(g.name)
            if not state:
                continue
            got = self._gather("opt", g.name, [s.path for s in state])
            for s in state:
                flat[s.index] = unslice(self.program.leaves[s.param], got[s.path])
        return jax.tree_util.tree_unflatten(self.update_plan.state_tree, flat)

    def close(self) -> None:
        self.handed_over = reuse.Held()
        self.stores.close()
