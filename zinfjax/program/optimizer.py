"""An optax transformation, run one unit at a time and exactly as on the whole tree.

`UpdatePlan` traces ``tx.init`` and ``tx.update`` once on the user's whole (fp32) parameter tree,
then runs them per *unit*: one slice of a streamed group (a layer, a row chunk of the vocabulary),
or a whole group. See `zinfjax.program.slicing` for how: elementwise transformations need one
sweep over the units, so each layer is updated as soon as its gradient exists; per-tensor
statistics (lamb's trust ratio, lars, adafactor's RMS, a global norm, ``apply_if_finite``'s global
finite check) need one more sweep per reduction, whose partials the engine combines between sweeps.

Optimizer state leaves belong to the parameter whose key path ends theirs (``0/mu/blocks/fc/kernel``
belongs to ``blocks/fc/kernel``). A state leaf with its parameter's leading axis is stored sliced
with it; every other state leaf (counts, a factored second moment that spans the streamed axis)
is *global*: one small value kept in memory.

Example:
    >>> from zinfjax.program import program_for
    >>> def loss_fn(params, batch):               # three layers: a scan over their stacked weights
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
    ...     return jnp.mean(h ** 2)
    >>> program = program_for(loss_fn, {"blocks": jnp.ones((3, 8, 8))}, jnp.ones((8, 8)))
    >>> UpdatePlan(optax.adam(1e-3), program).sweeps, UpdatePlan(optax.lamb(1e-3), program).sweeps
    (1, 3)
    >>> plan = UpdatePlan(optax.adam(1e-3), program)     # lamb: a sweep more per norm of its trust ratio
    >>> layer = [jnp.ones((1, 8, 8))]                    # layer 0, its streamed axis kept
    >>> state = plan.init_unit("s:blocks", 1)(layer, 0)
    >>> partials, new, state = plan.unit("s:blocks", 0, 1)(layer, layer, state, plan.init_globals(), [], 0)
    >>> round(float(new[0][0, 0, 0]), 6)                 # one Adam step of 1e-3 down
    0.999
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zinfjax.program import jaxpr as jx
from zinfjax.program.frozen import frozen_leaves
from zinfjax.program.memo import instance_cache
from zinfjax.program.slicing import (
    CALLS,
    UNTAGGED,
    Info,
    NotStreamableError,
    SlicedEvaluator,
    Tag,
    Window,
    analyze,
    combine,
    cond_operands,
)
from zinfjax.program.split import Program, plain_keys
from zinfjax.sharding import path_str

NO_CALLS = lambda jaxpr: False  # noqa: E731 - inline every call: the update is never differentiated


@dataclasses.dataclass(frozen=True)
class StateLeaf:
    """One leaf of the optax state: its path, shape, dtype, and the group it is stored with (None: global)."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    group: str | None
    param: int | None  # the parameter leaf it belongs to
    keys: tuple = ()  # its key path as plain keys


class UpdatePlan:
    """``tx`` over a program's groups: per-unit init and update functions, and how many sweeps they need.

    Raises:
        NotStreamableError: the transformation couples slices in a way that cannot be split.
    """

    def __init__(self, tx: optax.GradientTransformation, program: Program):
        self.tx, self.program = tx, program
        leaves = program.leaves
        self.params_like = jax.tree_util.tree_unflatten(
            program.params_tree, [jax.ShapeDtypeStruct(leaf.opt_shape, jnp.float32) for leaf in leaves])
        state_like = jax.eval_shape(tx.init, self.params_like)
        flat, self.state_tree = jax.tree_util.tree_flatten_with_path(state_like)
        self.state = [dataclasses.replace(self._state_leaf(k, path_str(p), x), keys=plain_keys(p))
                      for k, (p, x) in enumerate(flat)]
        self._param_tags = [self._tag(leaf.group) for leaf in leaves]
        self._trace_update(state_like)
        self._trace_init()

    # ---- state leaves --------------------------------------------------------------------------

    def _state_leaf(self, k: int, path: str, x) -> StateLeaf:
        owner = _owner_index(path, [leaf.path for leaf in self.program.leaves])
        group = None
        if owner is not None and np.ndim(x) >= 1:
            leaf = self.program.leaves[owner]
            if leaf.stream is None or (np.shape(x)[0] == leaf.opt_shape[0]):
                group = leaf.group
        return StateLeaf(k, path, tuple(np.shape(x)), np.dtype(x.dtype), group, owner if group else None)

    def _tag(self, group: str | None) -> Tag | None:
        if group is None:
            return None
        return Tag(group, 0 if self.program.groups[group].streamed else None)

    def state_of(self, group: str) -> list[StateLeaf]:
        """The state leaves stored with ``group``, in state order."""
        return [s for s in self.state if s.group == group]

    def user_shape(self, s: StateLeaf) -> tuple[int, ...]:
        """State leaf ``s``'s shape in the user's tree: a tiled parameter's state has its parameter's shape (the
        update sees it with the layer and tile axes merged, `Leaf.opt_shape`)."""
        owner = self.program.leaves[s.param] if s.param is not None else None
        return owner.shape if owner is not None and owner.stream is not None and owner.stream.tiles else s.shape

    @functools.cached_property
    def frozen(self) -> frozenset[int]:
        """The leaves whose update is zero by construction (`zinfjax.program.frozen`): never updated nor written."""
        return frozen_leaves(self)

    @instance_cache  # asked per unit in the step's loop
    def frozen_group(self, group: str) -> bool:
        """Whether every leaf of ``group`` is frozen: it has no update to run, nothing to write back."""
        return all(k in self.frozen for k in self.program.groups[group].leaves)

    @property
    def globals(self) -> list[StateLeaf]:
        """The state leaves kept whole in memory."""
        return [s for s in self.state if s.group is None]

    # ---- tracing -------------------------------------------------------------------------------

    def _trace_update(self, state_like) -> None:
        tx = self.tx

        def update(params, grads, state):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        closed, _ = jx.trace(update, self.params_like, self.params_like, state_like)
        closed = jx.inline_calls(closed, keep=NO_CALLS, names=CALLS, conds=True)
        n = len(self.program.leaves)
        jaxpr = closed.jaxpr
        self.u_closed = closed
        self.u_params, self.u_grads = jaxpr.invars[:n], jaxpr.invars[n : 2 * n]
        self.u_state = jaxpr.invars[2 * n :]
        known = {c: UNTAGGED for c in jaxpr.constvars}
        known.update({v: Info(t) for v, t in zip(self.u_params, self._param_tags, strict=True)})
        known.update({v: Info(t) for v, t in zip(self.u_grads, self._param_tags, strict=True)})
        known.update({v: Info(self._tag(s.group)) for v, s in zip(self.u_state, self.state, strict=True)})
        self.crosses: list = []
        self.u_info = analyze(jaxpr.eqns, known, self.crosses)
        self.u_new_params, self.u_new_state = jaxpr.outvars[:n], jaxpr.outvars[n:]
        self._check_outputs()
        tagged = [self._info(v).phase for v in self.u_new_params + self.u_new_state if self._info(v).tag is not None]
        self.sweeps = 1 + max(tagged, default=0)

    def _info(self, atom) -> Info:
        return self.u_info.get(atom, UNTAGGED) if jx.is_var(atom) else UNTAGGED

    def _check_outputs(self) -> None:
        for leaf, v in zip(self.program.leaves, self.u_new_params, strict=True):
            got = self._info(v).tag
            if got is not None and got != self._param_tags[leaf.index]:
                raise AssertionError(f"the update of {leaf.path} is streamed along {got}, not its own axis")
        for s, v in zip(self.state, self.u_new_state, strict=True):
            got = self._info(v).tag
            if got is not None and got != self._tag(s.group):
                raise NotStreamableError(f"optimizer state {s.path} is computed from parameters it does not belong "
                                         "to, so it cannot be updated one layer at a time")

    def _trace_init(self) -> None:
        closed, _ = jx.trace(self.tx.init, self.params_like)
        closed = jx.inline_calls(closed, keep=NO_CALLS, names=CALLS, conds=True)
        known = {c: UNTAGGED for c in closed.jaxpr.constvars}
        known.update({v: Info(t) for v, t in zip(closed.jaxpr.invars, self._param_tags, strict=True)})
        crosses: list = []
        self.i_closed = closed
        self.i_info = analyze(closed.jaxpr.eqns, known, crosses)
        if crosses:
            raise NotStreamableError("the optimizer's init reduces over whole parameters; zinfjax initialises its "
                                     "state one layer at a time")

    # ---- per-unit functions --------------------------------------------------------------------

    def window(self, group: str, i: int) -> Window | None:
        """The part of ``group``'s streamed axis that unit ``i`` holds (None for a whole group)."""
        g = self.program.groups[group]
        if not g.streamed:
            return None
        leaf = self.program.leaves[g.leaves[0]]
        s = leaf.stream
        if s.rows == 0:
            return Window(i, 1, leaf.opt_shape[0])
        return Window(i * s.rows, s.valid_rows(i, leaf.shape[0]), leaf.shape[0])

    def crosses_of(self, group: str, sweep: int) -> list:
        """The cross eqns whose partials units of ``group`` compute in ``sweep``."""
        return [c for c in self.crosses if c.group == group and c.phase == sweep]

    def totals_before(self, sweep: int) -> list:
        """Cross outputs combined before ``sweep`` starts."""
        return [c.out for c in self.crosses if c.phase < sweep]

    def part_state(self, group: str, part: tuple[int, ...] | None) -> list[StateLeaf]:
        """The state leaves of ``group`` that belong to the parameter leaves ``part`` (all when None)."""
        return [s for s in self.state_of(group) if part is None or s.param in part]

    @instance_cache  # computed once per group
    def separable(self, group: str) -> bool:
        """Whether each leaf of ``group`` is updated (and initialised) from its own parameter, gradient and
        state alone, with the global state: then a part of the group's leaves can be updated without the rest.

        Example:
            >>> from zinfjax.program import program_for
            >>> def loss_fn(params, batch):               # three layers: a scan over their stacked weights
            ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
            ...     return jnp.mean(h ** 2)
            >>> program = program_for(loss_fn, {"blocks": jnp.ones((3, 8, 8))}, jnp.ones((8, 8)))
            >>> UpdatePlan(optax.adamw(1e-3), program).separable("s:blocks")
            True
            >>> clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))   # one norm over every leaf
            >>> UpdatePlan(clipped, program).separable("s:blocks")
            False
        """
        if self.sweeps != 1 or self.crosses_of(group, 0):
            return False
        inputs = set(self.u_params) | set(self.u_grads) | {self.u_state[s.index] for s in self.state if s.group}
        i_inputs = set(self.i_closed.jaxpr.invars)
        for k in self.program.groups[group].leaves:
            state = self.part_state(group, (k,))
            own = {self.u_params[k], self.u_grads[k], *(self.u_state[s.index] for s in state)}
            outs = [self.u_new_params[k]] + [self.u_new_state[s.index] for s in state]
            if _reads(_needed(self.u_closed.jaxpr.eqns, outs, set()), outs) & inputs - own:
                return False
            i_outs = [self.i_closed.jaxpr.outvars[s.index] for s in state]
            if _reads(jx.dce(self.i_closed.jaxpr.eqns, i_outs), i_outs) & i_inputs - {self.i_closed.jaxpr.invars[k]}:
                return False
        return True

    @instance_cache  # one compiled function per (group, sweep, slice size, part), for the plan's life
    def unit(self, group: str, sweep: int, size: int | None = None, part: tuple[int, ...] | None = None):
        """A jitted ``f(params, grads, state, globals, totals, start) -> (partials, new_params, new_state)``.

        ``params``/``grads`` are the group's leaves (in group order) and ``state`` its state leaves,
        each holding the unit's window with the streamed axis kept (a layer is ``(1, ...)``);
        ``globals`` the global state leaves; ``totals`` the combined cross values of earlier sweeps;
        ``start`` where the unit's window starts. New params and state come only from the last sweep.
        ``part`` (leaf indices of a `separable` group) restricts all of these to those leaves and their state.
        """
        jaxpr = self.u_closed.jaxpr
        g = self.program.groups[group]
        last = sweep == self.sweeps - 1
        partial_vars = [c.out for c in self.crosses_of(group, sweep)]
        if part is not None and (partial_vars or not self.separable(group)):
            raise AssertionError(f"the update of {group} does not split by leaf")
        param_idx = [k for k in g.leaves if part is None or k in part]
        state_idx = [s.index for s in self.part_state(group, part)]
        outs = ([self.u_new_params[k] for k in param_idx] + [self.u_new_state[k] for k in state_idx]) if last else []
        total_vars = self.totals_before(sweep)
        eqns = _needed(jaxpr.eqns, outs + partial_vars, set(total_vars))
        full = self.window(group, 0).full if g.streamed else None

        def f(params, grads, state, globals_, totals, start):
            env = dict(zip(jaxpr.constvars, self.u_closed.consts, strict=True))
            env.update({self.u_params[k]: x for k, x in zip(param_idx, params, strict=True)})
            env.update({self.u_grads[k]: x for k, x in zip(param_idx, grads, strict=True)})
            env.update({self.u_state[k]: x for k, x in zip(state_idx, state, strict=True)})
            env.update({self.u_state[s.index]: x for s, x in zip(self.globals, globals_, strict=True)})
            window = _DynamicWindow(start, size, full) if full is not None else None
            ev = SlicedEvaluator(self.u_info, window, dict(zip(total_vars, totals, strict=True)), sweep, group)
            env = ev.run(eqns, env)
            new = [ev.as_tagged(jx.read(env, v), self._info(v).tag or self._tag(group)) for v in outs]
            return [ev.partials[v] for v in partial_vars], new[: len(param_idx)], new[len(param_idx):]

        return jax.jit(f)

    @instance_cache
    def finish(self):
        """A jitted ``f(globals, totals) -> new globals``: the global state after the last sweep."""
        jaxpr = self.u_closed.jaxpr
        outs = [self.u_new_state[s.index] for s in self.globals]
        total_vars = [c.out for c in self.crosses]
        eqns = _needed(jaxpr.eqns, outs, set(total_vars))

        def f(globals_, totals):
            env = dict(zip(jaxpr.constvars, self.u_closed.consts, strict=True))
            env.update({self.u_state[s.index]: x for s, x in zip(self.globals, globals_, strict=True)})
            env.update(zip(total_vars, totals, strict=True))
            env = jx.evaluate([e for e in eqns if not all(v in env for v in e.outvars if jx.is_var(v))], env)
            return [jx.read(env, v) for v in outs]

        return jax.jit(f)

    @instance_cache
    def init_unit(self, group: str, size: int | None = None, part: tuple[int, ...] | None = None):
        """A jitted ``f(params, start) -> state``: the unit's share of ``tx.init`` (streamed axis kept);
        ``part`` as for `unit`."""
        jaxpr = self.i_closed.jaxpr
        g = self.program.groups[group]
        param_idx = [k for k in g.leaves if part is None or k in part]
        state_idx = [s.index for s in self.part_state(group, part)]
        outs = [jaxpr.outvars[k] for k in state_idx]
        eqns = jx.dce(jaxpr.eqns, outs)
        full = self.window(group, 0).full if g.streamed else None

        def f(params, start):
            env = dict(zip(jaxpr.constvars, self.i_closed.consts, strict=True))
            env.update({jaxpr.invars[k]: x for k, x in zip(param_idx, params, strict=True)})
            window = _DynamicWindow(start, size, full) if full is not None else None
            ev = SlicedEvaluator(self.i_info, window, {}, 0, group)
            env = ev.run(eqns, env)
            return [ev.as_tagged(jx.read(env, v), self._tag(group)) for v in outs]

        return jax.jit(f)

    def init_globals(self) -> list:
        """The global state leaves as ``tx.init`` makes them (they never depend on the parameters)."""
        jaxpr = self.i_closed.jaxpr
        outs = [jaxpr.outvars[s.index] for s in self.globals]
        eqns = jx.dce(jaxpr.eqns, outs)
        for v in jx.free_vars(eqns):
            if v in jaxpr.invars:
                raise NotStreamableError("the optimizer's init computes global state from the parameters")
        env = jx.evaluate(eqns, dict(zip(jaxpr.constvars, self.i_closed.consts, strict=True)))
        return [jnp.asarray(jx.read(env, v)) for v in outs]


def combine_partials(crosses: list, parts: dict) -> dict:
    """Totals ``{cross output var: value}`` from ``parts``: ``{cross output var: [partial per unit]}``."""
    return {c.out: combine(c.how, parts[c.out]) for c in crosses if c.out in parts}


class _DynamicWindow(Window):
    """A `Window` whose start is traced, so one compiled function serves every slice of a size."""

    def __init__(self, start, size: int, full: int):
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "full", full)

    def cut(self, x, dim):
        if dim is None or np.ndim(x) <= dim or np.shape(x)[dim] != self.full or self.full == self.size:
            return x
        return jax.lax.dynamic_slice_in_dim(x, self.start, self.size, axis=dim)


def _needed(eqns, outs, given: set) -> list:
    """The eqns ``outs`` need, where the outputs in ``given`` are supplied (their eqns are not run).

    A cond needs only the operands of its live outputs, so a cond over the whole tree, split per
    group, does not pull in the other groups' leaves.
    """
    live = {v for v in outs if jx.is_var(v)}
    kept = []
    for eqn in reversed(eqns):
        defined = [v for v in eqn.outvars if jx.is_var(v)]
        if not any(v in live for v in defined):
            continue
        kept.append(eqn)
        if all(v in given for v in defined):
            continue
        if eqn.primitive.name == "cond":
            wanted = [k for k, v in enumerate(eqn.outvars) if v in live]
            reads = [eqn.invars[0]] + [eqn.invars[1 + j] for j in cond_operands(eqn, wanted)]
        else:
            reads = eqn.invars
        live.update(a for a in reads if jx.is_var(a))
    return kept[::-1]


def _reads(eqns, outs) -> set:
    """The variables computing ``outs`` with ``eqns`` reads from outside them (``outs`` themselves included)."""
    defined = {v for e in eqns for v in e.outvars if jx.is_var(v)}
    return set(jx.free_vars(eqns)) | {v for v in outs if jx.is_var(v) and v not in defined}


def _owner_index(path: str, param_paths: list[str]) -> int | None:
    """The parameter whose path ends ``path`` at a ``/`` (the longest such), or None."""
    best, best_len = None, -1
    for k, p in enumerate(param_paths):
        if (path == p or path.endswith("/" + p)) and len(p) > best_len:
            best, best_len = k, len(p)
    return best


def owner_of(path: str, param_paths: list[str]) -> str | None:
    """The parameter path that ends the state leaf path ``path`` (the longest), or None.

    Example:
        >>> owner_of("0/mu/blocks/fc/kernel", ["blocks/fc/kernel", "fc/kernel"])
        'blocks/fc/kernel'
    """
    k = _owner_index(path, param_paths)
    return None if k is None else param_paths[k]
