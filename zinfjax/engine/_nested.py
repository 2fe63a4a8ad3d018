"""The operations of a scan whose body scans over tiles: each layer run as its body's stages, one tile at a time.

`zinfjax.program.nested` cuts such a body into whole stretches and tile scans (a `Body`). For each layer
``i`` the forward runs them in order: a stretch reads unit ``i`` of the layer groups it uses; a tile scan
reads unit ``i * tiles + t`` of its tile groups for each tile ``t``, a prefetched operation each. The
backward runs them in reverse, and updates each unit as soon as its gradient is complete: a tile right
after its backward, a layer group after the backward of the body stage that owns it.

The values one layer's stages pass each other (the carry entering each tile, a norm's output that every
tile reads) are the layer's activation checkpoints: they are held in memory from the layer's forward to
its backward, as the engine holds a whole stage's residuals (docs/engine.md, "Tiles"); with saved
residuals (``recompute``) each stage's and tile's backward takes its forward's instead of rerunning it.
The parameters are never held: every tile and layer part is read for its forward and again for its
backward.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from zinfjax.engine._step_io import track
from zinfjax.engine.readahead import Read
from zinfjax.program.residuals import differentiable, zero_cotangent


class NestedScan:
    """The forward and backward operations of one nested scan stage within a `zinfjax.engine._step.Step`."""

    def __init__(self, step, stage, op, label: str):
        self.step, self.stage, self.body, self.op, self.label = step, stage, stage.body, op, label
        self.engine, self.io, self.program = step.engine, step.io, step.program
        self.fns = self.engine.stage_fns.body_fns(stage.position)
        self.whole = set(stage.params)  # the outer scan's whole parameters (flax variable_broadcast)
        self.fwd: dict = {}  # the outer loop's state in the forward
        self.bwd: dict = {}  # ... and in the backward
        self.envs: dict = {}  # layer -> the body's values of that layer, held until its backward
        self.carries: dict = {}  # (layer, body position, tile) -> the carry entering that tile
        self.cts: dict = {}  # the cotangents of the body's values, for the layer whose backward runs
        self.pending: dict = {}  # leaf -> its gradient so far, for the layer whose backward runs
        self.outer_params: dict = {}  # the outer scan's whole parameters, read at its begin
        self.layer: dict = {}  # the current layer's own group (its leaves that are not tiles), read once per layer
        self.layer_trees: dict = {}
        self.layer_groups = sorted(g.name for g in self.program.groups.values() if g.position == stage.position
                                   and g.sub is not None and not self.program.leaves[g.leaves[0]].stream.tiles)

    # ---- units and reads ---------------------------------------------------------------------

    def _unit(self, group: str, i: int, t: int = 0) -> int:
        tiles = self.program.leaves[self.program.groups[group].leaves[0]].stream.tiles
        return i * tiles + t if tiles else i

    def _groups(self, leaves) -> list[str]:
        """The tile groups ``leaves`` belong to: what a body stage reads itself (the layer's group is held)."""
        return sorted({self.program.leaves[k].group for k in leaves
                       if k not in self.whole and self.program.leaves[k].stream.tiles})

    def _reads(self, groups, i: int, t: int = 0) -> list:
        return [Read(track("params", g), self.engine.stores.params[g], self._unit(g, i, t)) for g in groups]

    def _params(self, leaves, groups, trees) -> dict:
        """``{leaf: value}`` for a body stage: the outer whole parameters, the layer's held, the tiles read."""
        out = {k: self.outer_params[k] for k in leaves if k in self.whole}
        out.update({k: self.layer[k] for k in leaves if k in self.layer})
        out.update(self.step._values([k for k in leaves if k not in out], groups, trees))
        return out

    def _read_layer(self, i: int, updating: bool) -> list:
        """The reads of layer ``i``'s own group (and, in the backward, its update's): once per layer."""
        reads = self._reads(self.layer_groups, i)
        if updating:
            reads += [r for g in self.layer_groups for r in self.step.updates.reads(g, i)]
        return reads

    def _hold_layer(self, trees: list) -> list:
        """The layer group's values held for the layer's stages (``self.layer``); the rest of ``trees``."""
        n = len(self.layer_groups)
        leaves = [k for g in self.layer_groups for k in self.program.groups[g].leaves]
        self.layer = self.step._values(leaves, self.layer_groups, trees[:n])
        self.layer_trees = dict(zip(self.layer_groups, trees[:n], strict=True))
        return trees[n:]

    # ---- forward -----------------------------------------------------------------------------

    def forward(self) -> list:
        stage, step = self.stage, self.step
        groups, reads = step._param_reads(stage.params, 0)

        def begin(trees):
            self.outer_params = step._values(stage.params, groups, trees)
            self.fwd["carry"] = step._carry_init(stage, self.outer_params)
            self.fwd["ys"] = {}

        ops = [self.op("scan_begin", stage.position, reads, begin)]
        for i in stage.order():
            ops.append(self.op("layer_begin", i, self._read_layer(i, False), functools.partial(self._enter, i)))
            for sub in self.body.stages:
                ops += self._whole_fwd(sub, i) if sub.kind == "whole" else self._tiles_fwd(sub, i)
            ops.append(self.op("layer_end", i, [], functools.partial(self._leave, i)))
        ops.append(self.op("scan_end", stage.position, [], self._end))
        return ops

    def _enter(self, i: int, trees) -> None:
        """Layer ``i``'s body inputs: the carry, the scan's residual consts, and slice ``i`` of its residual xs;
        and its own group, held for its stages."""
        self._hold_layer(trees)
        stage, env, a = self.stage, {}, self.engine.micro
        n_c, n_k = stage.num_consts, stage.num_carry
        for j, (kind, what) in enumerate(stage.operands):
            var = self.body.inputs[j]
            if n_c <= j < n_c + n_k:
                env[var] = self.fwd["carry"][j - n_c]
            elif kind == "var":
                env[var] = self.step.env[what] if j < n_c else self.step.env[what][:, i]
            elif kind == "literal":
                env[var] = jnp.broadcast_to(jnp.asarray(what), (a, *np.shape(what)))
        self.envs[i] = env

    def _whole_fwd(self, sub, i: int) -> list:
        groups = self._groups(sub.params)

        def run(trees):
            env = self.envs[i]
            params = self._params(sub.params, groups, trees)
            args = (f"{self._label(sub)}_fwd", i)
            ins = [env[v] for v in sub.inputs]
            if self.engine.saves_residuals:  # kept for the backward, which then reruns nothing
                outs, self.step.kept[self._key(i, sub)] = self.io.dispatch(
                    *args, self.fns.whole_fwd_saving(sub.position), params, ins)
            else:
                outs = self.io.dispatch(*args, self.fns.whole_fwd(sub.position), params, ins)
            env.update(zip(sub.outputs, outs, strict=True))

        return [self.op("part_fwd", i, self._reads(groups, i), run)]

    def _tiles_fwd(self, sub, i: int) -> list:
        state: dict = {}
        groups, tiles = self._groups(sub.params), self._groups(sub.streams)

        def begin(trees):
            env = self.envs[i]
            state["params"] = self._params(sub.params, groups, trees)
            state["carry"] = [env[what] if kind == "var" else self._broadcast(kind, what, state["params"])
                              for kind, what in sub.carry_init]
            state["ys"] = {}

        ops = [self.op("tiles_begin", i, self._reads(groups, i), begin)]
        for t in sub.order():
            def run(trees, t=t):
                env = self.envs[i]
                slices = self.step._values(sub.streams, tiles, trees)
                args = (f"{self._label(sub)}_fwd", t)
                ins, xs = [env[v] for v in sub.const_vars], [env[v][:, t] for v in sub.xs_vars]
                if self.engine.saves_residuals:
                    state["carry"], state["ys"][t], self.step.kept[self._key(i, sub, t)] = self.io.dispatch(
                        *args, self.fns.scan_fwd_saving(sub.position), state["params"], slices, ins, state["carry"],
                        xs)
                    return
                self.carries[(i, sub.position, t)] = state["carry"]
                state["carry"], state["ys"][t] = self.io.dispatch(
                    *args, self.fns.scan_fwd(sub.position), state["params"], slices, ins, state["carry"], xs)

            ops.append(self.op("tile_fwd", t, self._reads(tiles, i, t), run))

        def end(_):
            env = self.envs[i]
            env.update(zip([c.var for c in sub.loop.carry], state["carry"], strict=True))
            for j, y in enumerate(sub.loop.ys):
                if not y.dropped:
                    env[y.var] = jnp.stack([state["ys"][t][j] for t in range(sub.length)], axis=1)
            state.clear()

        ops.append(self.op("tiles_end", i, [], end))
        return ops

    def _broadcast(self, kind: str, what, params: dict):
        value = params[what] if kind == "param" else jnp.asarray(what)
        return jnp.broadcast_to(value, (self.engine.micro, *np.shape(value)))

    def _leave(self, i: int, _) -> None:
        outs = [self.envs[i][what] if kind == "var" else what for kind, what in self.body.results]
        n_k = self.stage.num_carry
        self.fwd["carry"], self.fwd["ys"][i] = outs[:n_k], outs[n_k:]
        self.layer = {}

    def _end(self, _) -> None:
        stage, step = self.stage, self.step
        step.final_carry[stage.position] = self.fwd["carry"]
        values = dict(zip([c.var for c in stage.loop.carry], self.fwd["carry"], strict=True))
        for j, y in enumerate(stage.loop.ys):
            if y.var in stage.outputs:
                values[y.var] = jnp.stack([self.fwd["ys"][i][j] for i in range(stage.length)], axis=1)
        step.env.update({v: values[v] for v in stage.outputs})
        self.fwd.clear()

    # ---- backward ----------------------------------------------------------------------------

    def _key(self, i: int, sub, t: int = -1) -> tuple:
        """Where a body stage's saved residuals wait for its backward (`Step.kept`)."""
        return ("nested", self.stage.position, i, sub.position, t)

    def _label(self, sub) -> str:
        return f"{self.label}.{sub.kind}{sub.position}"

    def _ct(self, v):
        """The cotangent of the body's variable ``v`` so far (zeros when it has none yet, None for integers)."""
        if v in self.cts:
            return self.cts[v]
        return zero_cotangent(self.envs[self.bwd["layer"]][v]) if differentiable(v.aval) else None

    def _add_ct(self, v, c) -> None:
        """Adds ``c`` to the cotangent of the body's variable ``v`` (never a literal: callers pass variables)."""
        if c is None or not differentiable(v.aval):
            return
        self.cts[v] = self.cts[v] + c if v in self.cts else c

    def _add_grads(self, grads: dict) -> None:
        for k, g in grads.items():
            target = self.bwd["d_params"] if k in self.whole else self.pending
            target[k] = target[k] + g if k in target else g

    def backward(self) -> list:
        stage, step = self.stage, self.step
        groups, reads = step._param_reads(stage.params, 0)

        def begin(trees):
            self.outer_params = step._values(stage.params, groups, trees)
            self.bwd["d_carry"] = [step._cotangent(c.var) if c.var in stage.outputs else None for c in stage.loop.carry]
            self.bwd.update(d_ins={}, d_xs={}, d_params={})

        ops = [self.op("scan_bwd_begin", stage.position, reads, begin)]
        for i in reversed(stage.order()):
            ops.append(self.op("layer_bwd_begin", i, self._read_layer(i, True), functools.partial(self._bwd_enter, i)))
            for sub in reversed(self.body.stages):
                ops += self._whole_bwd(sub, i) if sub.kind == "whole" else self._tiles_bwd(sub, i)
            ops.append(self.op("layer_bwd_end", i, [], functools.partial(self._bwd_leave, i)))
        ops.append(self.op("scan_bwd_end", stage.position, [], self._bwd_end))
        return ops

    def _bwd_enter(self, i: int, trees) -> None:
        """The cotangents of layer ``i``'s outputs: its carry's, from the layer above, and its ys'; its own group
        and what its update reads, held until the layer's backward ran."""
        self.bwd["upd"] = self._hold_layer(trees)
        self.bwd["layer"], self.cts, self.pending = i, {}, {}
        n_k, results = self.stage.num_carry, self.body.results
        for (kind, v), c in zip(results[:n_k], self.bwd["d_carry"], strict=True):
            if kind == "var":
                self._add_ct(v, c)
        for (kind, v), outer in zip(results[n_k:], self.stage.loop.ys, strict=True):
            if kind == "var" and outer.var in self.step.cts:
                self._add_ct(v, self.step.cts[outer.var][:, i])

    def _update_layer(self, i: int) -> None:
        """Layer ``i``'s own group, updated from the gradients its stages left (zeros for a leaf none used)."""
        upd = self.bwd.pop("upd")
        for g in self.layer_groups:
            n = len(self.step.updates.reads(g, i))
            grads = [self.pending.pop(k, None) for k in self.program.groups[g].leaves]
            grads = [jnp.zeros(self.program.leaves[k].slice_shape, jnp.float32) if x is None else x
                     for k, x in zip(self.program.groups[g].leaves, grads, strict=True)]
            self.step.updates.update_unit(g, i, self.layer_trees[g], grads, upd[:n])
            upd = upd[n:]

    def _whole_bwd(self, sub, i: int) -> list:
        groups = self._groups(sub.params)

        def run(trees):
            env = self.envs[i]
            params = self._params(sub.params, groups, trees[: len(groups)])
            d_outs = [self._ct(v) for v in sub.outputs]
            args = (f"{self._label(sub)}_bwd", i)
            if self.engine.saves_residuals:
                d_params, d_ins = self.io.dispatch(*args, self.fns.whole_bwd_saved(sub.position), params,
                                                   self.step.kept.pop(self._key(i, sub)), d_outs)
            else:
                d_params, d_ins = self.io.dispatch(*args, self.fns.whole_bwd(sub.position), params,
                                                   [env[v] for v in sub.inputs], d_outs)
            for v, c in zip(sub.inputs, d_ins, strict=True):
                self._add_ct(v, c)
            self._add_grads(d_params)

        return [self.op("part_bwd", i, self._reads(groups, i), run)]

    def _tiles_bwd(self, sub, i: int) -> list:
        state: dict = {}
        groups, tiles = self._groups(sub.params), self._groups(sub.streams)

        def begin(trees):
            state["params"] = self._params(sub.params, groups, trees)
            state["d_carry"] = [self._ct(c.var) for c in sub.loop.carry]
            state.update(d_ins=None, d_xs={})

        ops = [self.op("tiles_bwd_begin", i, self._reads(groups, i), begin)]
        for t in reversed(sub.order()):
            reads = self._reads(tiles, i, t)
            for g in tiles:
                reads += self.step.updates.reads(g, self._unit(g, i, t))
            ops.append(self.op("tile_bwd", t, reads, functools.partial(self._tile_step, sub, state, i, t, tiles)))

        def end(trees):
            for v, c in zip(sub.const_vars, state["d_ins"] or [], strict=False):
                self._add_ct(v, c)
            for (kind, what), c in zip(sub.carry_init, state["d_carry"], strict=True):
                if kind == "var":
                    self._add_ct(what, c)
            for j, v in enumerate(sub.xs_vars):
                if differentiable(v.aval):
                    self._add_ct(v, jnp.stack([state["d_xs"][t][j] for t in range(sub.length)], axis=1))
            state.clear()

        ops.append(self.op("tiles_bwd_end", i, [], end))
        return ops

    def _tile_step(self, sub, state, i: int, t: int, tiles: list, trees: list) -> None:
        env, n = self.envs[i], len(tiles)
        slices = self.step._values(sub.streams, tiles, trees[:n])
        d_ys = [self.cts[y.var][:, t] if y.var in self.cts else zero_cotangent(env[y.var][:, t])
                if differentiable(y.like) else None for y in sub.loop.ys]
        args = (f"{self._label(sub)}_bwd", t)
        if self.engine.saves_residuals:
            d_params, d_slices, d_ins, state["d_carry"], d_xs = self.io.dispatch(
                *args, self.fns.scan_bwd_saved(sub.position), state["params"], slices,
                self.step.kept.pop(self._key(i, sub, t)), state["d_carry"], d_ys)
        else:
            d_params, d_slices, d_ins, state["d_carry"], d_xs = self.io.dispatch(
                *args, self.fns.scan_bwd(sub.position), state["params"], slices, [env[v] for v in sub.const_vars],
                self.carries.pop((i, sub.position, t)), [env[v][:, t] for v in sub.xs_vars], state["d_carry"], d_ys)
        self._add_grads(d_params)
        state["d_ins"] = d_ins if state["d_ins"] is None else [
            a if b is None else b if a is None else a + b for a, b in zip(state["d_ins"], d_ins, strict=True)]
        state["d_xs"][t] = d_xs
        rest = trees[n:]
        for g, copy in zip(tiles, trees[:n], strict=True):
            unit = self._unit(g, i, t)
            upd = self.step.updates.reads(g, unit)
            grads = [d_slices[k] for k in self.program.groups[g].leaves]
            self.step.updates.update_unit(g, unit, copy, grads, rest[: len(upd)])
            rest = rest[len(upd):]

    def _bwd_leave(self, i: int, _) -> None:
        """The carry's cotangent for the layer below, and layer ``i``'s share of the consts' and xs' cotangents."""
        stage, n_c, n_k = self.stage, self.stage.num_consts, self.stage.num_carry
        invars = self.body.inputs
        self.bwd["d_carry"] = [self.cts.get(v) for v in invars[n_c : n_c + n_k]]
        xs = {}
        for j, (kind, what) in enumerate(stage.operands):
            if kind != "var" or n_c <= j < n_c + n_k:
                continue
            c = self.cts.get(invars[j])
            if j < n_c and c is not None:
                d = self.bwd["d_ins"]
                d[what] = d[what] + c if what in d else c
            elif j >= n_c + n_k:
                xs[what] = c
        self.bwd["d_xs"][i] = xs
        self._update_layer(i)
        self.layer, self.layer_trees = {}, {}
        if self.pending:
            raise AssertionError(f"gradients of {sorted(self.pending)} were left without their update")
        self.envs.pop(i)
        self.cts = {}

    def _bwd_end(self, _) -> None:
        stage, step = self.stage, self.step
        for what, c in self.bwd["d_ins"].items():
            step._add_ct(what, c)
        for (kind, what), c in zip(stage.carry_init, self.bwd["d_carry"], strict=True):
            if kind == "var" and c is not None:
                step._add_ct(what, c)
        for what in stage.xs_vars:
            if differentiable(what.aval):
                parts = [self.bwd["d_xs"][i].get(what) for i in range(stage.length)]
                if all(p is not None for p in parts):
                    step._add_ct(what, jnp.stack(parts, axis=1))
        step.updates.add_grads(self.bwd["d_params"])
        self.bwd.clear()
        self.outer_params = {}
