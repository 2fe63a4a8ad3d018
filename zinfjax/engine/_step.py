"""The streaming step: a program's stages run one layer at a time, with every part of the state on its tier.

The forward pass runs the program's stages in order (`zinfjax.program.split`): a whole stage reads
the groups of parameters it uses; a streamed scan reads its parameters one slice (a layer, a row
chunk) at a time, ``prefetch_depth`` slices ahead, and writes the carry entering each iteration to
the activation tier. The backward pass walks the stages in reverse, recomputes each iteration inside
its VJP, and as soon as a unit's gradient is complete (its first user in forward order has run its
backward) hands it to the optimizer (`zinfjax.engine._update`): updated at once when the
transformation is elementwise, or spooled to the gradient tier when it needs more sweeps (per-tensor
norms, a global norm, fp16's overflow check) and updated after the backward pass (docs/design.md,
invariant 1).

Every read of a step is known before the step starts: the step is a list of operations, each with
the reads it needs, and `ReadAhead` keeps the next ``prefetch_depth`` operations' reads in flight.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.engine import reuse
from zinfjax.engine._nested import NestedScan
from zinfjax.engine._step_io import StepEngine, StepIO, track
from zinfjax.engine._update import Updates
from zinfjax.engine.readahead import Read
from zinfjax.engine.stores import dir_name
from zinfjax.program.residuals import differentiable, zero_cotangent
from zinfjax.program.split import Program


@dataclasses.dataclass(eq=False)
class Op:
    """One operation of a step: the reads it needs, and what it does with them."""

    name: str
    layer: int
    reads: list
    run: Callable[[list], None]


class Step:
    """One training step's operations and the values that flow between them: its forward and backward."""

    def __init__(self, engine: StepEngine, io: StepIO, batch: list, keys):
        self.engine, self.io, self.program = engine, io, engine.program
        self.env: dict = dict(zip(self.program.batch_vars, batch, strict=True))
        if self.program.rng_var is not None:
            self.env[self.program.rng_var] = keys
        self.cts: dict = {}
        self.updates = Updates(engine, io)  # the optimizer's side: the gradients it is given, its updates
        self.written: set = set()  # (acts position, i) and ("grads", group, i) once written
        self.kept = _Kept()  # a stage's (or scan iteration's) saved residuals until its backward
        self.held = reuse.Held()  # parameters the forward read, kept for the backward (engine.reuse)
        self.final_carry: dict = {}  # each scan's last carry, by position: the shape of its cotangent
        self.nests: dict = {}  # the scans whose bodies scan over tiles, by position (`NestedScan`)
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
        if stage.body is not None:
            return self._nested(stage).forward()
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
            self.final_carry[stage.position] = state["carry"]
            values = dict(zip([c.var for c in stage.loop.carry], state["carry"], strict=True))
            for j, y in enumerate(stage.loop.ys):
                if y.var in stage.outputs:
                    values[y.var] = jnp.stack([state["ys"][i][j] for i in range(stage.length)], axis=1)
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
        """Adds ``c`` to the cotangent of ``v``, a variable a stage reads (its inputs: never a literal)."""
        program = self.program
        if c is None or v in program.batch_vars or v is program.rng_var or not differentiable(v.aval):
            return
        self.cts[v] = self.cts[v] + c if v in self.cts else c

    def _completed(self, position: int) -> list:
        """Whole groups whose gradient is complete once the stage at ``position`` has run its backward."""
        return [g for g in self.program.groups.values() if not g.streamed and g.position == position]

    def _nested(self, stage) -> NestedScan:
        if stage.position not in self.nests:
            self.nests[stage.position] = NestedScan(self, stage, Op, label(self.program, stage))
        return self.nests[stage.position]

    def _backward(self, stage) -> list[Op]:
        if stage.kind == "scan" and stage.body is not None:
            return self._nested(stage).backward() + self._update_done(stage.position)
        if stage.kind == "scan":
            return self._scan_backward(stage)
        groups, reads = self._param_reads(stage.params, 0)
        done = self._completed(stage.position)
        extra = [r for g in done for r in self.updates.reads(g.name, 0)]

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
            self.updates.add_grads(d_params)
            for v, c in zip(stage.inputs, d_ins, strict=True):
                self._add_ct(v, c)
            self.updates.update_whole(done, dict(zip(groups, trees[: len(groups)], strict=True)), trees[len(groups):])

        return [Op("whole_bwd", stage.position, reads + extra, run)]

    def _scan_backward(self, stage) -> list[Op]:
        state: dict = {}
        groups, reads = self._param_reads(stage.params, 0)
        acts = self.engine.stores.acts[stage.position]
        owned = [g for g in self.program.streamed_groups() if g.position == stage.position]

        def begin(trees):
            state["params"] = self._values(stage.params, groups, trees)
            state["d_carry"] = [self._cotangent(c.var) if c.var in stage.outputs else None for c in stage.loop.carry]
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
                    extra += self.updates.reads(g.name, i)
                if g.name in self.io.tied:
                    extra.append(Read(track("grads", g.name), self._store("grads", g.name), i,
                                      ready=lambda g=g, i=i: ("grads", g.name, i) in self.written))
            ops.append(Op("scan_bwd", i, [r for _, r in read] + act + extra,
                          functools.partial(self._scan_step, stage, state, i, s_groups, [g for g, _ in read], owned)))
            ops += [Op("update_part", i, self.updates.reads(g.name, i, part),
                       functools.partial(self.updates.update_part, g.name, i, part))
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
            self.updates.add_grads(state["d_params"])
            state.clear()

        ops.append(Op("scan_bwd_end", stage.position, [], end))
        return ops + self._update_done(stage.position)

    def _update_done(self, position: int) -> list[Op]:
        """The update of the whole groups whose gradient is complete once the scan at ``position`` ran its backward."""
        done = self._completed(position)
        for g in [g for g in done if self.engine.update_plan.frozen_group(g.name)]:  # nothing to read or update
            self.updates.discard(g.name)
        done = [g for g in done if not self.engine.update_plan.frozen_group(g.name)]
        if not done:
            return []
        reads = [Read(track("params", g.name), self._store("params", g.name), 0) for g in done]
        reads += [r for g in done for r in self.updates.reads(g.name, 0)]
        return [Op("update_whole", position, reads, lambda trees: self.updates.update_whole(
            done, dict(zip([g.name for g in done], trees[: len(done)], strict=True)), trees[len(done):]))]

    def _casts_compute_copy(self, group: str, position: int, i: int) -> bool:
        """Whether the backward of unit ``i`` of ``group`` takes its compute copy from the fp32 master its fused
        update reads anyway, cast as the update casts it (bit for bit the copy the store holds), instead of
        reading the copy too: when that read would cost a transfer (NVMe, or host memory on an accelerator)."""
        engine = self.engine
        if not engine.stores.master or engine.spools_gradients or engine.on_host or group in engine.parts:
            return False
        if engine.update_plan.frozen_group(group):  # a frozen group's update reads no master to cast from
            return False
        if (position, i) in engine.reuse:
            return False
        return self._store("params", group).memory_kind_at(i) != "device"

    def _scan_step(self, stage, state, i: int, s_groups, read_groups, owned, trees) -> None:
        n, saved = len(read_groups), self.engine.saves_residuals
        by_group = dict(zip(read_groups, trees[:n], strict=True))
        carry = self.final_carry[stage.position] if saved else [trees[n][f"carry{j}"] for j in range(stage.num_carry)]
        rest = list(trees[n + (0 if saved else 1):])
        reads = {}  # each owned group's update reads and spooled gradient, in the order `_scan_backward` listed them
        for g in owned:
            n_upd = 0 if g.name in self.engine.parts else len(self.updates.reads(g.name, i))
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
        d_ys = [self.cts[y.var][:, i] if y.var in self.cts else
                zero_cotangent(jax.ShapeDtypeStruct((self.engine.micro, *y.like.shape[1:]), y.like.dtype))
                if differentiable(y.like) else None for y in stage.loop.ys]
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
            grads = [self._grad(d_slices, k) for k in g.leaves]
            in_parts = g.name in self.engine.parts
            upd, spooled = reads[g.name]
            if spooled is not None:
                grads = [a + spooled[self.program.leaves[k].path] for k, a in zip(g.leaves, grads, strict=True)]
            if in_parts:  # the update_part operations that follow take them (and the compute copy, as the master
                # when there is no other: with one, it goes now)
                own = None if self.engine.stores.master else by_group[g.name]
                self.updates.hold(g.name, i, own, dict(zip(g.leaves, grads, strict=True)))
            else:
                self.updates.update_unit(g.name, i, by_group[g.name], grads, upd)
        for group in sorted(({self.program.leaves[k].group for k in stage.streams} - {g.name for g in owned})
                            & self.io.tied.keys()):  # a frozen group is not tied (`Engine`): no share to spool
            leaves = self.program.groups[group].leaves
            self._contribute(group, i, {self.program.leaves[k].path: d_slices[k] for k in leaves if k in d_slices})

    def _grad(self, d_slices: dict, k: int):
        """Leaf ``k``'s gradient from a backward; zeros for a frozen leaf, which the backward does not differentiate
        (`StageFunctions.frozen`) and whose update, where one still runs, is zero whatever it is given."""
        if k in d_slices:
            return d_slices[k]
        return jnp.zeros(self.program.leaves[k].slice_shape, jnp.float32)

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
        reads += self.updates.reads("w:unused", 0)
        return [Op("update_unused", 0, reads, lambda trees: self.updates.update_whole(
            unused, {"w:unused": trees[0]}, trees[1:]))]


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


def label(program: Program, stage) -> str:
    """A stage's name in traces: the group a scan owns (``blocks``), else ``stage<position>``."""
    if stage.kind == "scan":
        owned = [g for g in program.streamed_groups() if g.position == stage.position]
        if owned:
            return dir_name(owned[0].name)
    return f"stage{stage.position}"
