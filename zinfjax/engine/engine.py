"""The streaming step: a program's stages run one layer at a time, with every part of the state on its tier.

The forward pass runs the program's stages in order (`zinfjax.program.split`): a whole stage reads
the groups of parameters it uses; a streamed scan reads its parameters one slice (a layer, a row
chunk) at a time, ``prefetch_depth`` slices ahead, and writes the carry entering each iteration to
the activation tier. The backward pass walks the stages in reverse, recomputes each iteration inside
its VJP, and as soon as a unit's gradient is complete (its first user in forward order has run its
backward) hands it to the optimizer: updated at once when the transformation is elementwise, or
spooled to the gradient tier when it needs more sweeps (per-tensor norms, a global norm, fp16's
overflow check) and updated after the backward pass (docs/design.md, invariant 1).

Every read of a step is known before the step starts: the step is a list of operations, each with
the reads it needs, and `ReadAhead` keeps the next ``prefetch_depth`` operations' reads in flight.

ZeRO stages 0-3 and tensor parallelism are sharding rules (`Placement`, zinfjax/sharding.py): every
store holds its leaves in their kind's layout, the stage functions gather parameters and scatter
gradients inside their jitted bodies, and each update runs on the optimizer state's shards.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from zinfjax import allocator
from zinfjax.config import Config
from zinfjax.engine import crash_marker, reuse
from zinfjax.engine._step_io import StepEngine, StepIO, track
from zinfjax.engine.budget import (
    LIVE_BASE,
    NVME_MMAP_THRESHOLD,
    memory_capped,
)
from zinfjax.engine.compile_cache import compiled
from zinfjax.engine.engine_plan import PlanInputs, plan_engine, update_location
from zinfjax.engine.loss_scale import LossScale
from zinfjax.engine.parts import Part
from zinfjax.engine.readahead import Read, ReadAhead
from zinfjax.engine.store_plan import (
    build_stores,
    dir_name,
    spools_gradients,
    store_specs,
    tied_groups,
)
from zinfjax.engine.telemetry import StepTelemetry
from zinfjax.engine.writebehind import WriteBehind
from zinfjax.errors import UserError
from zinfjax.program import jaxpr as jx
from zinfjax.program.optimizer import combine_partials
from zinfjax.program.residuals import differentiable, residual_bytes, zero_cotangent
from zinfjax.program.split import Program, unslice
from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules
from zinfjax.store.layout import HOST_KINDS, host_tier_kind
from zinfjax.vocabulary import COMPUTE_DTYPES


class BatchError(UserError):
    """A batch that does not match what the state was wrapped for."""


@dataclasses.dataclass(eq=False)
class Op:
    """One operation of a step: the reads it needs, and what it does with them."""

    name: str
    layer: int
    reads: list
    run: Callable[[list], None]


class Engine:
    """Trains a `Program` with its state on the tiers of ``config``.

    ``source`` gives the initial state unit by unit (`zinfjax.engine.source`). ``config.stage``
    shards the state over the mesh axis ``data``; a ``model`` axis splits it by ``tp_rules``.

    Example:
        >>> engine = Engine(program, TreeSource(program, plan, params), optax.adamw(1e-3), config, mesh)
        >>> metrics = engine.train_step(batch)
    """

    def __init__(self, program: Program, source, tx: optax.GradientTransformation, config: Config, mesh: Mesh,
                 tp_rules: tuple = (), threshold: int = PERSISTENCE_THRESHOLD):
        self.program, self.config, self.mesh, self.tx = program, config, mesh, tx
        self.compute_dtype = COMPUTE_DTYPES[config.precision]
        self.rules = ShardingRules.for_mesh(mesh, config.stage, tp_rules, threshold)
        self.platform = mesh.devices.flat[0].platform  # "cpu", "gpu", "tpu"
        self.update_on = update_location(config, self.platform)
        self.on_host = self.update_on == "host"
        # The host tier's memory kind, and why it is not pinned_host (recorded in the log): `host_tier_kind`.
        self.host_kind, self.host_kind_fallback = host_tier_kind(mesh.devices.flat[0], self.on_host)
        params_kind = self.host_kind if self.on_host and config.params != "device" else "device"
        layout = compiled(program, tx, self.rules, mesh, self.compute_dtype, config.grad_accum, self.on_host,
                          params_kind, self.host_kind)
        self.placement, self.stage_fns = layout.placement, layout.stage_fns
        self.plan, self.units = layout.plan, layout.units
        self.loss_scale = LossScale(config.precision == "fp16")
        self.spools_gradients = spools_gradients(config, self.plan)
        self.micro = config.grad_accum
        self._check_micro_batch()
        self._tied = self._tied_groups()
        specs, acts = store_specs(config, program, self.plan, self.placement, self.compute_dtype)
        self.residual_bytes = self._residual_bytes()
        planned = plan_engine(PlanInputs(config, program, self.plan, specs, list(acts.values()), self.platform,
                                         self.residual_bytes, self.spools_gradients, self.on_host))
        self.parts, self.budget, self.saves_residuals = planned.parts, planned.budget, planned.saves_residuals
        self.reuse = planned.reuse
        self.handoff = planned.handoff  # not "carry": that is a scan's loop carry
        self.handed_over = reuse.Held()  # the compute copies the last step's updates handed to the next forward
        # While the state is written at the start, no step holds its operations' memory: writes may use it.
        fill_bound = self.budget.write_bytes_in_flight + LIVE_BASE * planned.needs[0]
        self.capped = config.uses_nvme and memory_capped(config, self.budget)
        if self.capped:  # freed layer buffers leave the heap at once (docs/design.md, invariant 2)
            allocator.tune_allocator(mmap_threshold=NVME_MMAP_THRESHOLD, trim_threshold=allocator.GLIBC_TRIM_THRESHOLD)
        self.config = config = config.replace(prefetch_depth=self.budget.prefetch_depth,
                                              host_buffer_bytes=self.budget.host_buffer_bytes)
        self.step_count = int(getattr(source, "step", 0))
        self.tracer = None  # a zinfjax.engine.trace.Tracer while one is attached
        self._behind = WriteBehind(fill_bound, config.prefetch_depth)  # the computations and writes in flight
        self._telemetry: StepTelemetry | None = None
        self._steps_run = 0
        self.stores = build_stores(config, specs, acts, self.parts, self.host_kind)
        self.interrupted_step = crash_marker.interrupted(config)
        try:
            self._fill(source)
        except BaseException:
            self.stores.close()
            raise
        self._release_scratch()

    # ---- set-up ------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Slices of the longest streamed group (the layers of a transformer)."""
        return max((g.length for g in self.program.streamed_groups()), default=1)

    def _residual_bytes(self) -> int:
        """What this process's devices hold of one step's saved residuals, at most (`residual_bytes`): the
        batch's rows split over the data axis."""
        total = residual_bytes(self.program, self.micro)
        return total * len(self.mesh.local_devices) // self.mesh.shape["data"]

    def _check_micro_batch(self) -> None:
        data = self.mesh.shape["data"]
        rows = {np.shape(x)[0] for x in self.program.batch_like if np.ndim(x)}
        bad = [r for r in rows if r % data]
        if bad:
            raise BatchError(f"a micro-batch of {bad[0]} rows does not split over the {data} devices of the data "
                             f"axis; make batch_size / grad_accum a multiple of {data}")

    def _tied_groups(self) -> dict[str, int]:
        return tied_groups(self.program)

    def _release_scratch(self) -> None:
        """With the state on nvme, memory is the budget: give the compiler's freed scratch back to the system."""
        if self.config.uses_nvme:
            allocator.trim()

    def _fill(self, source) -> None:
        """Writes the initial state into the stores, one unit at a time."""
        s = self.stores
        given = source.globals()
        self.globals = list(given) if given is not None else self.plan.init_globals()
        for g in self.program.groups.values():
            leaves = self.program.leaves_of(g.name)
            for i in range(g.length):
                params = dict(zip([leaf.path for leaf in leaves], source.params(g.name, i), strict=True))
                given_state = source.state(g.name, i)
                if given_state is not None:
                    given_state = dict(zip([st.path for st in self.plan.state_of(g.name)], given_state, strict=True))
                for part in self.parts.get(g.name, [None]):
                    paths, state_paths = self.units.paths(g.name, part and part.leaves)
                    compute, master, state = self.units.init(g.name, self.units.size(g.name, i), part and part.leaves)(
                        [params.pop(p) for p in paths], self.units.start(g.name, i))
                    if given_state is not None:
                        state = [given_state[p] for p in state_paths]
                    keys = part and part.params
                    self._write("fill", s.params[g.name], i, dict(zip(paths, compute, strict=True)), keys)
                    if s.master:
                        self._write("fill", s.master[g.name], i, dict(zip(paths, master, strict=True)), keys)
                    if state_paths:
                        self._write("fill", s.opt[g.name], i, dict(zip(state_paths, state, strict=True)),
                                    part and part.state)
            s.flush()
        self._behind.bound = self.budget.write_bytes_in_flight
        if self.loss_scale.enabled and getattr(source, "loss_scale", None) is not None:
            self.loss_scale.scale = float(source.loss_scale)
            self.loss_scale.good = int(getattr(source, "loss_scale_good", 0))

    # ---- the step ----------------------------------------------------------------------------

    def train_step(self, batch, rng=None) -> dict:
        """One optimizer step on ``batch`` (a pytree of arrays with a leading batch axis); returns its metrics."""
        crash_marker.begin(self.config, self.step_count + 1)
        if self.capped:  # the last step's freed buffers leave the heap before this one's peak
            allocator.trim()
        telemetry = self._telemetry = StepTelemetry(self.stores.all(), self.tracer)
        try:
            io = StepIO(self._dispatch, self._write, self._tied, telemetry)
            step = _Step(self, io, self._micro_batches(batch), self._keys(rng))
            reads = ReadAhead([op.reads for op in step.ops], self.config.prefetch_depth)
            for op, results in zip(step.ops, reads, strict=True):
                op.run(results)
            telemetry.add_reads(reads)
            updated = step.finish_update()
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
        crash_marker.end(self.config)
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
        key = rng if rng is not None else jax.random.fold_in(jax.random.key(self.config.seed), self.step_count + 1)
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
            self._telemetry.add_write(store, keys, from_host)
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
        kind = kind if kind == "params" or self.stores.master else "params"
        flat = [None] * len(self.program.leaves)
        for g in self.program.groups.values():
            leaves = self.program.leaves_of(g.name)
            got = self._gather(kind, g.name, [leaf.path for leaf in leaves])
            for leaf in leaves:
                flat[leaf.index] = unslice(leaf, got[leaf.path])
        return jax.tree_util.tree_unflatten(self.program.params_tree, flat)

    def opt_state(self):
        """The whole optax state, gathered: what ``tx.init`` and ``tx.update`` of the whole tree would hold."""
        flat = [None] * len(self.plan.state)
        for s, x in zip(self.plan.globals, self.globals, strict=True):
            flat[s.index] = x
        for g in self.program.groups.values():
            state = self.plan.state_of(g.name)
            if not state:
                continue
            got = self._gather("opt", g.name, [s.path for s in state])
            for s in state:
                flat[s.index] = unslice(self.program.leaves[s.param], got[s.path])
        return jax.tree_util.tree_unflatten(self.plan.state_tree, flat)

    def close(self) -> None:
        self.handed_over = reuse.Held()
        self.stores.close()


class _Step:
    """One training step's operations and the values that flow between them."""

    def __init__(self, engine: StepEngine, io: StepIO, batch: list, keys):
        self.engine, self.io, self.program = engine, io, engine.program
        self.env: dict = dict(zip(self.program.batch_vars, batch, strict=True))
        if self.program.rng_var is not None:
            self.env[self.program.rng_var] = keys
        self.cts: dict = {}
        self.whole_grads: dict = {}
        self.pending: dict = {}  # (group, i) -> (its params, {leaf: gradient}) until its update parts have run
        self.written: set = set()  # (acts position, i) and ("grads", group, i) once written
        self.kept = _Kept()  # a stage's (or scan iteration's) saved residuals until its backward
        self.held = reuse.Held()  # parameters the forward read, kept for the backward (engine.reuse)
        self.final_carry: dict = {}  # each scan's last carry, by position: the shape of its cotangent
        self.partials: dict = {}
        self.finite: list = []
        self.loss = None
        self.scale = jnp.float32(engine.loss_scale.value)
        self.ops: list[Op] = []
        for stage in self.program.stages:
            self.ops += self._forward(stage)
        for stage in reversed(self.program.stages):
            self.ops += self._backward(stage)
        self.ops += self._unused()

    @property
    def kept_bytes(self) -> int:
        """The most bytes of saved residuals this process held at once in the step."""
        return self.kept.peak

    # ---- reads -------------------------------------------------------------------------------

    def _store(self, kind: str, group: str):
        return self.engine.stores.kind(kind)[group]

    def _param_reads(self, leaves, i: int) -> tuple[list, list]:
        groups = sorted({self.program.leaves[k].group for k in leaves})
        return groups, [Read(track("params", g), self._store("params", g), i) for g in groups]

    def _update_reads(self, group: str, i: int, part: Part | None = None) -> list:
        """What a fused update of unit ``i`` (or of its leaves ``part``) needs beyond what the backward read:
        opt (and master)."""
        if self.engine.spools_gradients:
            return []
        reads, kind = [], self._update_kind("optimizer")
        if self.engine.plan.part_state(group, part and part.leaves):
            reads.append(Read(track("opt", group), self._store("opt", group), i, keys=part and part.state,
                              memory_kind=kind))
        if self.engine.stores.master:
            reads.append(Read(track("master", group), self._store("master", group), i, keys=part and part.params,
                              memory_kind=kind))
        return reads

    def _update_kind(self, tier_key: str) -> str:
        """The memory kind the update reads state of the tier ``tier_key`` into: host memory for the update on
        the host (unless the state is on the device), else device memory."""
        on_device = getattr(self.engine.config, tier_key) == "device"
        return self.engine.host_kind if self.engine.on_host and not on_device else "device"

    def _values(self, leaves, groups, trees) -> dict:
        by_group = dict(zip(groups, trees, strict=False))
        return {k: by_group[self.program.leaves[k].group][self.program.leaves[k].path] for k in leaves}

    # ---- forward -----------------------------------------------------------------------------

    def _forward(self, stage) -> list[Op]:
        if stage.kind == "whole":
            groups, reads = self._param_reads(stage.params, 0)

            def run(trees, stage=stage, groups=groups):
                params = self._values(stage.params, groups, trees)
                ins = [self.env[v] for v in stage.inputs]
                name = f"{label(self.program, stage)}_fwd"
                if self.engine.saves_residuals:
                    fwd = self.engine.stage_fns.whole_fwd_saving(stage.position)
                    outs, self.kept[stage.position] = self.io.dispatch(name, stage.position, fwd, params, ins)
                else:
                    outs = self.io.dispatch(name, stage.position, self.engine.stage_fns.whole_fwd(stage.position),
                                            params, ins)
                self.env.update(zip(stage.outputs, outs, strict=True))
                if self.program.loss_var in stage.outputs:
                    self.loss = self.env[self.program.loss_var]

            return [Op("whole_fwd", stage.position, reads, run)]
        return self._scan_forward(stage)

    def _carry_init(self, stage, params: dict) -> list:
        a = self.engine.micro
        out = []
        for kind, what in stage.carry_init:
            if kind == "var":
                out.append(self.env[what])
                continue
            value = params[what] if kind == "param" else jnp.asarray(what)
            out.append(jnp.broadcast_to(value, (a, *np.shape(value))))
        return out

    def _scan_forward(self, stage) -> list[Op]:
        state: dict = {}
        groups, reads = self._param_reads(stage.params, 0)

        def begin(trees):
            state["params"] = self._values(stage.params, groups, trees)
            state["carry"] = self._carry_init(stage, state["params"])
            state["ys"] = {}

        ops = [Op("scan_begin", stage.position, reads, begin)]
        acts = self.engine.stores.acts[stage.position]
        for i in stage.order():
            s_groups, s_reads = self._param_reads(stage.streams, i)
            handed = self.engine.handed_over  # the owner's forward is the first use of what the last step updated
            s_reads = [Read(r.track, handed.slot((g, i), 0), i)
                       if handed.has((g, i)) and self.program.groups[g].position == stage.position else r
                       for g, r in zip(s_groups, s_reads, strict=True)]

            def run(trees, i=i, s_groups=s_groups):
                slices = self._values(stage.streams, s_groups, trees)
                if (stage.position, i) in self.engine.reuse:
                    self.held.keep((stage.position, i), trees)
                ins = [self.env[v] for v in stage.const_vars]
                xs = [self.env[v][:, i] for v in stage.xs_vars]
                args = (f"{label(self.program, stage)}_fwd", i)
                if self.engine.saves_residuals:  # the residuals replace the activation checkpoint
                    fwd = self.engine.stage_fns.scan_fwd_saving(stage.position)
                    state["carry"], state["ys"][i], self.kept[(stage.position, i)] = self.io.dispatch(
                        *args, fwd, state["params"], slices, ins, state["carry"], xs)
                    return
                carry = {f"carry{j}": c for j, c in enumerate(state["carry"])}
                self.io.write(f"acts_{label(self.program, stage)}", acts, i, carry)
                self.written.add((stage.position, i))
                fwd = self.engine.stage_fns.scan_fwd(stage.position)
                state["carry"], state["ys"][i] = self.io.dispatch(*args, fwd, state["params"], slices, ins,
                                                                  state["carry"], xs)

            ops.append(Op("scan_fwd", i, s_reads, run))

        def end(_):
            outvars = stage.eqn.outvars
            n_k = stage.num_carry
            self.final_carry[stage.position] = state["carry"]
            values = dict(zip(outvars[:n_k], state["carry"], strict=True))
            for j, v in enumerate(outvars[n_k:]):
                if v in stage.outputs:
                    values[v] = jnp.stack([state["ys"][i][j] for i in range(stage.length)], axis=1)
            self.env.update({v: values[v] for v in stage.outputs})
            state.clear()

        ops.append(Op("scan_end", stage.position, [], end))
        return ops

    # ---- backward ----------------------------------------------------------------------------

    def _cotangent(self, v):
        """``v``'s cotangent so far: zeros when it has none yet, None when its values (integers) carry none."""
        if v in self.cts:
            return self.cts[v]
        if v is self.program.loss_var:
            return jnp.broadcast_to(self.scale.astype(v.aval.dtype), self.env[v].shape)
        return zero_cotangent(self.env[v]) if differentiable(v.aval) else None

    def _add_ct(self, v, c) -> None:
        program = self.program
        if c is None or not jx.is_var(v) or v in program.batch_vars or v is program.rng_var or not differentiable(
                v.aval):
            return
        self.cts[v] = self.cts[v] + c if v in self.cts else c

    def _add_grads(self, grads: dict) -> None:
        for k, g in grads.items():
            self.whole_grads[k] = self.whole_grads[k] + g if k in self.whole_grads else g

    def _completed(self, position: int) -> list:
        """Whole groups whose gradient is complete once the stage at ``position`` has run its backward."""
        return [g for g in self.program.groups.values() if not g.streamed and g.position == position]

    def _backward(self, stage) -> list[Op]:
        if stage.kind == "scan":
            return self._scan_backward(stage)
        groups, reads = self._param_reads(stage.params, 0)
        done = self._completed(stage.position)
        extra = [r for g in done for r in self._update_reads(g.name, 0)]

        def run(trees, stage=stage, groups=groups, done=done):
            params = self._values(stage.params, groups, trees[: len(groups)])
            d_outs = [self._cotangent(v) for v in stage.outputs]
            name, fns = f"{label(self.program, stage)}_bwd", self.engine.stage_fns
            if self.engine.saves_residuals:
                d_params, d_ins = self.io.dispatch(name, stage.position, fns.whole_bwd_saved(stage.position), params,
                                                   self.kept.pop(stage.position), d_outs)
            else:
                d_params, d_ins = self.io.dispatch(name, stage.position, fns.whole_bwd(stage.position), params,
                                                   [self.env[v] for v in stage.inputs], d_outs)
            self._add_grads(d_params)
            for v, c in zip(stage.inputs, d_ins, strict=True):
                self._add_ct(v, c)
            self._update_whole(done, dict(zip(groups, trees[: len(groups)], strict=True)), trees[len(groups):])

        return [Op("whole_bwd", stage.position, reads + extra, run)]

    def _scan_backward(self, stage) -> list[Op]:
        state: dict = {}
        groups, reads = self._param_reads(stage.params, 0)
        acts = self.engine.stores.acts[stage.position]
        owned = [g for g in self.program.streamed_groups() if g.position == stage.position]
        done = self._completed(stage.position)

        def begin(trees):
            state["params"] = self._values(stage.params, groups, trees)
            outvars = stage.eqn.outvars
            state["d_carry"] = [self._cotangent(v) if v in stage.outputs else None for v in outvars[: stage.num_carry]]
            state["d_ins"], state["d_xs"], state["d_params"] = None, {}, {}

        ops = [Op("scan_bwd_begin", stage.position, reads, begin)]
        for i in reversed(stage.order()):
            s_groups, s_reads = self._param_reads(stage.streams, i)
            if (stage.position, i) in self.engine.reuse:
                key = (stage.position, i)
                s_reads = [Read(r.track, self.held.slot(key, k), i, ready=lambda key=key: self.held.has(key))
                           for k, r in enumerate(s_reads)]
            cast = {g.name for g in owned if self._casts_compute_copy(g.name, stage.position, i)}
            read = [(g, r) for g, r in zip(s_groups, s_reads, strict=True) if g not in cast]
            act = [] if self.engine.saves_residuals else [Read(
                f"acts_{label(self.program, stage)}", acts, i, ready=lambda i=i: (stage.position, i) in self.written)]
            extra = []
            for g in owned:
                if g.name not in self.engine.parts:
                    extra += self._update_reads(g.name, i)
                if g.name in self.io.tied:
                    extra.append(Read(track("grads", g.name), self._store("grads", g.name), i,
                                      ready=lambda g=g, i=i: ("grads", g.name, i) in self.written))
            ops.append(Op("scan_bwd", i, [r for _, r in read] + act + extra,
                          functools.partial(self._scan_step, stage, state, i, s_groups, [g for g, _ in read], owned)))
            ops += [Op("update_part", i, self._update_reads(g.name, i, part),
                       functools.partial(self._update_part, g.name, i, part))
                    for g in owned for part in self.engine.parts.get(g.name, [])]

        def end(_):
            for v, c in zip(stage.const_vars, state["d_ins"] or [], strict=False):
                self._add_ct(v, c)
            for (kind, what), c in zip(stage.carry_init, state["d_carry"], strict=True):
                if kind == "var" and c is not None:
                    self._add_ct(what, c)
            for j, v in enumerate(stage.xs_vars):
                if differentiable(v.aval):  # the others' cotangents are None
                    self._add_ct(v, jnp.stack([state["d_xs"][i][j] for i in range(stage.length)], axis=1))
            self._add_grads(state["d_params"])
            state.clear()

        ops.append(Op("scan_bwd_end", stage.position, [], end))
        if done:
            reads = [Read(track("params", g.name), self._store("params", g.name), 0) for g in done]
            reads += [r for g in done for r in self._update_reads(g.name, 0)]
            ops.append(Op("update_whole", stage.position, reads,
                          lambda trees: self._update_whole(done, dict(zip([g.name for g in done],
                                                                          trees[: len(done)], strict=True)),
                                                           trees[len(done):])))
        return ops

    def _casts_compute_copy(self, group: str, position: int, i: int) -> bool:
        """Whether the backward of unit ``i`` of ``group`` takes its compute copy from the fp32 master its fused
        update reads anyway, cast as the update casts it (bit for bit the copy the store holds), instead of
        reading the copy too: when that read would cost a transfer (NVMe, or host memory on an accelerator)."""
        engine = self.engine
        if not engine.stores.master or engine.spools_gradients or engine.on_host or group in engine.parts:
            return False
        if (position, i) in engine.reuse:
            return False
        return self._store("params", group).memory_kind != "device"

    def _scan_step(self, stage, state, i: int, s_groups, read_groups, owned, trees) -> None:
        n, saved = len(read_groups), self.engine.saves_residuals
        by_group = dict(zip(read_groups, trees[:n], strict=True))
        carry = self.final_carry[stage.position] if saved else [trees[n][f"carry{j}"] for j in range(stage.num_carry)]
        rest = list(trees[n + (0 if saved else 1):])
        reads = {}  # each owned group's update reads and spooled gradient, in the order `_scan_backward` listed them
        for g in owned:
            n_upd = 0 if g.name in self.engine.parts else len(self._update_reads(g.name, i))
            upd, rest = rest[:n_upd], rest[n_upd:]
            spooled = None
            if g.name in self.io.tied:
                spooled, rest = rest[0], rest[1:]
            reads[g.name] = (upd, spooled)
            if g.name not in by_group:  # `_casts_compute_copy`: the master is the last update read
                by_group[g.name] = self.io.dispatch(f"cast_{dir_name(g.name)}", i,
                                                    self.engine.units.compute_copy(g.name), upd[-1])
        slices = self._values(stage.streams, s_groups, [by_group[g] for g in s_groups])
        # A carry with no cotangent yet gets zeros, so every iteration's backward has one signature (integers: None).
        state["d_carry"] = [zero_cotangent(x) if c is None and differentiable(jax.typeof(x)) else c
                            for x, c in zip(carry, state["d_carry"], strict=True)]
        outvars = stage.eqn.outvars[stage.num_carry:]
        d_ys = [self.cts[v][:, i] if v in self.cts else
                zero_cotangent(jax.ShapeDtypeStruct((self.engine.micro, *v.aval.shape[1:]), v.aval.dtype))
                if differentiable(v.aval) else None for v in outvars]
        name = f"{label(self.program, stage)}_bwd"
        if saved:
            d_params, d_slices, d_ins, state["d_carry"], d_xs = self.io.dispatch(
                name, i, self.engine.stage_fns.scan_bwd_saved(stage.position), state["params"], slices,
                self.kept.pop((stage.position, i)), state["d_carry"], d_ys)
        else:
            ins = [self.env[v] for v in stage.const_vars]
            xs = [self.env[v][:, i] for v in stage.xs_vars]
            d_params, d_slices, d_ins, state["d_carry"], d_xs = self.io.dispatch(
                name, i, self.engine.stage_fns.scan_bwd(stage.position), state["params"], slices, ins, carry, xs,
                state["d_carry"], d_ys)
        for k, g in d_params.items():
            state["d_params"][k] = state["d_params"][k] + g if k in state["d_params"] else g
        if state["d_ins"] is None:
            state["d_ins"] = d_ins
        else:
            state["d_ins"] = [a if b is None else b if a is None else a + b
                              for a, b in zip(state["d_ins"], d_ins, strict=True)]
        state["d_xs"][i] = d_xs
        for g in owned:
            grads = [d_slices[k] for k in g.leaves]
            in_parts = g.name in self.engine.parts
            upd, spooled = reads[g.name]
            if spooled is not None:
                grads = [a + spooled[self.program.leaves[k].path] for k, a in zip(g.leaves, grads, strict=True)]
            if in_parts:  # the update_part operations that follow take them (and the compute copy, as the master
                # when there is no other: with one, it goes now)
                own = None if self.engine.stores.master else by_group[g.name]
                self.pending[(g.name, i)] = (own, dict(zip(g.leaves, grads, strict=True)))
            else:
                self._update_unit(g.name, i, by_group[g.name], grads, upd)
        for group in sorted({self.program.leaves[k].group for k in stage.streams} - {g.name for g in owned}):
            leaves = self.program.groups[group].leaves
            self._contribute(group, i, {self.program.leaves[k].path: d_slices[k] for k in leaves if k in d_slices})

    def _contribute(self, group: str, i: int, grads: dict) -> None:
        """A later scan's share of a tied parameter's gradient, spooled for its owner's backward."""
        store = self._store("grads", group)
        self.io.write(track("grads", group), store, i, {p: g.astype(jnp.float32) for p, g in grads.items()})
        self.written.add(("grads", group, i))

    def _unused(self) -> list[Op]:
        unused = [g for g in self.program.groups.values() if g.name == "w:unused"]
        if not unused:
            return []
        reads = [Read(track("params", "w:unused"), self._store("params", "w:unused"), 0)]
        reads += self._update_reads("w:unused", 0)
        return [Op("update_unused", 0, reads, lambda trees: self._update_whole(
            unused, {"w:unused": trees[0]}, trees[1:]))]

    # ---- updates -----------------------------------------------------------------------------

    def _update_whole(self, done, trees: dict, upd: list) -> None:
        for g in done:
            leaves = self.program.leaves_of(g.name)
            grads = [self.whole_grads.pop(leaf.index, None) for leaf in leaves]
            grads = [jnp.zeros(leaf.shape, jnp.float32) if x is None else x for leaf, x in zip(leaves, grads,
                                                                                               strict=True)]
            n = len(self._update_reads(g.name, 0))
            self._update_unit(g.name, 0, trees[g.name], grads, upd[:n])
            upd = upd[n:]

    def _update_part(self, group: str, i: int, part: Part, upd: list) -> None:
        """The update of the leaves ``part`` of unit ``i``, from the gradients its backward left."""
        params_tree, grads = self.pending[(group, i)]
        mine = [grads.pop(k) for k in part.leaves]
        if not grads:
            del self.pending[(group, i)]
        self._update_unit(group, i, params_tree, mine, upd, part)

    def _update_unit(self, group: str, i: int, params_tree: dict, grads: list, upd: list,
                     part: Part | None = None) -> None:
        """A unit's gradient is complete: update it (or its leaves ``part``) now (fused), or spool it for the sweeps."""
        engine = self.engine
        paths, state_paths = engine.units.paths(group, part and part.leaves)
        if engine.spools_gradients:
            spooled, finite = engine.units.spool(group)(grads)
            self.io.write(track("grads", group), self._store("grads", group), i,
                          dict(zip(paths, spooled, strict=True)))
            self.finite.append(finite)
            return
        has_state = bool(state_paths)
        opt = upd[0] if has_state else {}
        master = upd[1 if has_state else 0] if engine.stores.master else params_tree
        self._apply(group, i, [master[p] for p in paths], grads, [opt[p] for p in state_paths], sweep=0, totals=[],
                    grad_div=np.float32(1), donate=self._donated(group, i, has_state, grads), part=part)

    def _donated(self, group: str, i: int, has_state: bool, grads: list) -> tuple[int, ...]:
        """The fused update's arguments (master 0, gradients 1, state 2) whose buffers its outputs may take over
        (docs/design.md, invariant 2): its own gradient, and the master and state its stores hand over
        (`LayerStore.hands_over`: fresh buffers read from NVMe, or an in-memory tier's own arrays, which the
        outputs replace there at once).

        JAX gives each output the first donated argument of its shape and dtype, in argument order, and the
        outputs are (compute copy, master, state). So only sets in which every output then takes its own
        input's buffer are donated: an output written into a buffer that another output still reads makes
        XLA copy that input first (32 copies of Adam's m and v per GPT-2 layer, before).
        """
        engine = self.engine
        opt = self._store("opt", group) if has_state else None
        if engine.on_host:  # gradients and in-memory state come from the device: no buffers its host outputs can reuse
            return (2,) if opt is not None and opt.tier == "nvme" else ()
        state = opt is not None and opt.hands_over(i)
        master = self._store("master" if engine.stores.master else "params", group).hands_over(i)
        if not engine.stores.master:  # fp32: the compute copy is the master, and the first output
            return ((0,) if master else (1,)) + ((2,) if state else ())
        # Mixed precision: a gradient in the compute dtype becomes the compute copy; one in fp32 (a tied
        # parameter's, with a later stage's share added) would take the master's place.
        own = (1,) if all(g.dtype != jnp.float32 for g in grads) else ()
        return ((0,) if master else ()) + own + ((2,) if state and master else ())

    def _apply(self, group: str, i: int, master: list, grads: list, state: list, sweep: int, totals: list,
               grad_div, donate: tuple[int, ...] = (), part: Part | None = None) -> None:
        engine = self.engine
        leaves = part and part.leaves
        fn = engine.units.update(group, sweep, engine.units.size(group, i), donate, leaves)
        if engine.on_host:
            self.io.telemetry.add_link(self._link_bytes(master, grads, state, sweep))
        partials, compute, master, state = self.io.dispatch(f"update_{dir_name(group)}", i, fn, master, grads, state,
                                                            engine.globals, totals, engine.units.start(group, i),
                                                            grad_div)
        for c, value in zip(engine.plan.crosses_of(group, sweep), partials, strict=True):
            self.partials.setdefault(c.eqn.outvars[0], []).append(value)
        if sweep < engine.plan.sweeps - 1:
            return
        paths, state_paths = engine.units.paths(group, leaves)
        keys, host, write = part and part.params, engine.on_host, self.io.write
        if (group, i) in engine.handoff:  # the next step's forward reads it first (`engine_plan.plan_handoff`)
            engine.handed_over.keep((group, i), [dict(zip(paths, compute, strict=True))])
        write(track("params", group), self._store("params", group), i, dict(zip(paths, compute, strict=True)), keys,
              from_host=host)
        if engine.stores.master:
            write(track("master", group), self._store("master", group), i, dict(zip(paths, master, strict=True)), keys,
                  from_host=host)
        if state_paths:
            write(track("opt", group), self._store("opt", group), i, dict(zip(state_paths, state, strict=True)),
                  part and part.state, from_host=host)

    def _link_bytes(self, master: list, grads: list, state: list, sweep: int) -> int:
        """What the update on the host moves over the host link: its inputs that are in device memory, and
        (on the last sweep) the new compute copy when the parameters live on the device."""
        down = sum(x.nbytes for x in (*master, *grads, *state) if not on_host(x))
        up = 0
        if sweep == self.engine.plan.sweeps - 1 and self.engine.config.params == "device":
            up = sum(x.size for x in master) * jnp.dtype(self.engine.compute_dtype).itemsize
        return down + up

    def finish_update(self) -> list | None:
        """After the backward pass: the sweeps (when spooled), then the optimizer's new global state; None
        when the step was skipped (fp16's overflow)."""
        engine, plan = self.engine, self.engine.plan
        if engine.spools_gradients:
            finite = bool(jnp.all(jnp.stack(self.finite))) if self.finite else True
            if engine.config.precision == "fp16":
                engine.loss_scale.after_step(finite)
                if not finite:
                    return None
            engine.stores.flush()  # the spooled gradients land before the sweeps read them
            for sweep in range(plan.sweeps):
                self._sweep(sweep)
        totals = combine_partials(plan.crosses, self.partials)
        return list(plan.finish()(engine.globals, [totals[c.eqn.outvars[0]] for c in plan.crosses]))

    def _sweep(self, sweep: int) -> None:
        engine = self.engine
        totals_vars = engine.plan.totals_before(sweep)
        done = combine_partials([c for c in engine.plan.crosses if c.phase < sweep], self.partials)
        totals = [done[v] for v in totals_vars]
        units = [(g, i) for g in self.program.groups.values() for i in range(g.length)]
        source = "master" if engine.stores.master else "params"
        groups = []
        for g, i in units:
            reads = [Read(track(source, g.name), self._store(source, g.name), i,
                          memory_kind=self._update_kind("optimizer" if source == "master" else "params")),
                     Read(track("grads", g.name), self._store("grads", g.name), i,
                          memory_kind=self._update_kind("gradients"))]
            if engine.plan.state_of(g.name):
                reads.append(Read(track("opt", g.name), self._store("opt", g.name), i,
                                  memory_kind=self._update_kind("optimizer")))
            groups.append(reads)
        reads = ReadAhead(groups, engine.config.prefetch_depth)
        grad_div = jnp.float32(engine.loss_scale.value)
        for (g, i), trees in zip(units, reads, strict=True):
            paths = [leaf.path for leaf in self.program.leaves_of(g.name)]
            state = [trees[2][s.path] for s in engine.plan.state_of(g.name)] if len(trees) > 2 else []
            self._apply(g.name, i, [trees[0][p] for p in paths], [trees[1][p] for p in paths], state, sweep, totals,
                        grad_div)
        self.io.telemetry.add_reads(reads)


class _Kept(dict):
    """Saved residuals by stage (or scan iteration), counting the most bytes this process held at once."""

    def __init__(self):
        super().__init__()
        self.held = self.peak = 0

    def __setitem__(self, key, kept: list) -> None:
        super().__setitem__(key, kept)
        self.held += _local_bytes(kept)
        self.peak = max(self.peak, self.held)

    def pop(self, key):
        kept = super().pop(key)
        self.held -= _local_bytes(kept)
        return kept


def _local_bytes(arrays: list) -> int:
    return sum(s.data.nbytes for x in arrays for s in x.addressable_shards)


def on_host(x) -> bool:
    """Whether array ``x`` is in host memory (one of `HOST_KINDS`)."""
    return getattr(getattr(x, "sharding", None), "memory_kind", None) in HOST_KINDS


def label(program: Program, stage) -> str:
    """A stage's name in traces: the group a scan owns (``blocks``), else ``stage<position>``."""
    if stage.kind == "scan":
        owned = [g for g in program.streamed_groups() if g.position == stage.position]
        if owned:
            return dir_name(owned[0].name)
    return f"stage{stage.position}"

