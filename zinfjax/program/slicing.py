"""Running a whole-tree jaxpr one slice at a time: tags, phases and the sliced evaluator.

The optimizer update (and its init) is traced once on the whole parameter tree, so every
callable inside it (masks, ``multi_transform`` labels, schedules) is resolved on the tree the user
sees. zinfjax then evaluates that jaxpr on one *unit* at a time: one slice (a layer, or a row chunk)
of one streamed group, or one whole group.

Each variable gets a *tag*: ``Tag(group, dim)`` when it holds data of ``group`` whose axis ``dim``
is the streamed axis (``dim=None`` for a whole group), or no tag when it is the same for every unit
(a step count, a learning rate, a literal). Tags flow forward through the eqns. A reduction over
the streamed axis (a per-tensor norm, an RMS, a global-norm term) is a *cross* eqn: one unit sees
only its slice, so each unit computes a partial, the engine combines them, and whatever depends on
the total waits for the next sweep. A variable's *phase* is the number of such waits before it can
be computed, and the whole update needs ``max phase + 1`` sweeps over the units. Elementwise
transformations (adam, adamw, lion, sgd, ...) need one: each layer is updated as soon as its
gradient exists.

Anything that mixes slices in another way (a sort or cumulative sum over the layer axis, a
reshape that merges it) is refused by name.

Example (an update of one leaf of 3 layers, its layer axis streamed):
    >>> import jax.numpy as jnp
    >>> def sweeps(update):
    ...     jaxpr = jx.trace(update, jnp.ones((3, 8)))[0].jaxpr
    ...     tags = analyze(jaxpr.eqns, {v: Info(Tag("s:blocks", 0), 0) for v in jaxpr.invars})
    ...     return max(i.phase for i in tags.values()) + 1
    >>> sweeps(lambda g: -1e-3 * jnp.sign(g))               # elementwise, as lion: one sweep
    1
    >>> sweeps(lambda g: g / jnp.sqrt(jnp.sum(g * g)))      # a norm over every layer first, as lamb's: two
    2
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.errors import UserError
from zinfjax.program import jaxpr as jx


class NotStreamableError(UserError):
    """A computation couples the slices of a streamed leaf in a way that cannot run slice by slice."""


@dataclasses.dataclass(frozen=True)
class Tag:
    """Data of one group; ``dim`` is the variable's streamed axis, None for a whole group."""

    group: str
    dim: int | None


@dataclasses.dataclass(frozen=True)
class Info:
    """What the analysis knows of a variable: its tag (None: the same for every unit) and its phase."""

    tag: Tag | None
    phase: int = 0


UNTAGGED = Info(None, 0)

ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type copy copy_p cos cosh
custom_jvp_call_elementwise digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag integer_pow
is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or polygamma pow real reduce_precision
rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor shift_left shift_right_logical
shift_right_arithmetic population_count clz bitcast_convert_type random_gamma_grad zeta square_p
""".split())
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_and": "and",
              "reduce_or": "or", "reduce_prod": "prod"}
CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call")


@dataclasses.dataclass(frozen=True)
class Cross:
    """A cross eqn: its partial is computed per unit of ``group`` in sweep ``phase``, and combined by ``how``.

    ``out`` is the eqn's output variable: the name of its partials and of their total.
    """

    out: object
    group: str
    phase: int
    how: str  # "sum", "max", "min", "and", "or", "prod", or "only" (one unit holds the whole value)


def _refuse(eqn, tag: Tag, why: str = "") -> None:
    raise NotStreamableError(
        f"{eqn.primitive.name} mixes the slices of {tag.group.split(':', 1)[-1]} along its streamed axis"
        f"{': ' + why if why else ''}, so it cannot run one layer at a time; use a transformation that updates "
        "each layer on its own or combines layers only by reductions (sums, norms, max), which zinfjax computes "
        "exactly in extra sweeps (docs/engine.md, Optimizers)")


def _sub(eqn):
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
    if body is None:
        return None
    return (body.jaxpr, list(body.consts)) if hasattr(body, "consts") else (body, [])


def analyze(eqns, known: dict, crosses: list | None = None) -> dict:
    """Tags and phases of every variable ``eqns`` define, given ``known`` (variable -> Info) for their inputs.

    ``crosses`` (a list) collects the cross eqns met at this level. Raises `NotStreamableError`.
    """
    info = dict(known)

    def of(a) -> Info:
        return info.get(a, UNTAGGED) if jx.is_var(a) else UNTAGGED

    for eqn in eqns:
        ins = [of(a) for a in eqn.invars]
        outs = _rule(eqn, ins, crosses)
        for v, i in zip(eqn.outvars, outs, strict=True):
            if jx.is_var(v):
                info[v] = i
    return info


def _rule(eqn, ins: list[Info], crosses) -> list[Info]:
    name = eqn.primitive.name
    phase = max((i.phase for i in ins), default=0)
    tags = [(k, i.tag) for k, i in enumerate(ins) if i.tag is not None]
    n_out = len(eqn.outvars)
    if not tags:
        if name == "cond":
            _branch_infos(eqn, ins, crosses)  # cross eqns inside untagged branches cannot occur
        return [Info(None, phase)] * n_out
    groups = {t.group for _, t in tags}
    if name == "cond":  # a cond over a whole tree: each output depends on one group (checked in the branches)
        if ins[0].tag is not None:
            _refuse(eqn, ins[0].tag, "it branches on data of the leaf")
        return _branch_infos(eqn, ins, crosses)
    if len(groups) > 1:
        raise NotStreamableError(f"{name} combines parameters of different groups ({', '.join(sorted(groups))}) "
                                 "element by element, so they cannot be updated one group at a time")
    tag = tags[0][1]
    if name in REDUCTIONS or name == "argmax" or name == "argmin":
        return [_reduction(eqn, tag, phase, crosses)]
    if name in ELEMENTWISE:
        return [_elementwise(eqn, tags, phase)] * n_out
    if name == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        return [Info(Tag(tag.group, None if tag.dim is None else dims[tag.dim]), phase)]
    if name == "squeeze":
        return [Info(_squeezed(eqn, tag), phase)]
    if name == "expand_dims":
        return [Info(_expanded(eqn, tag), phase)]
    if name == "reshape":
        return [Info(_reshaped(eqn, tag), phase)]
    if name == "transpose":
        perm = tuple(eqn.params["permutation"])
        return [Info(Tag(tag.group, None if tag.dim is None else perm.index(tag.dim)), phase)]
    if name == "concatenate":
        if tag.dim is not None and eqn.params["dimension"] == tag.dim:
            _refuse(eqn, tag, "it concatenates along that axis")
        return [Info(tag, phase)]
    if name == "dot_general":
        return [_dot(eqn, ins, phase, crosses)]
    if name in CALLS:
        sub = _sub(eqn)
        body, consts = sub
        inner = analyze(body.eqns, dict(zip(body.invars, ins, strict=True)) | {c: UNTAGGED for c in body.constvars},
                        crosses)
        return [inner.get(v, UNTAGGED) if jx.is_var(v) else UNTAGGED for v in body.outvars]
    _refuse(eqn, tag, "zinfjax does not know how to run it on one slice")
    raise AssertionError  # unreachable


def _elementwise(eqn, tags, phase) -> Info:
    full = max(len(a.aval.shape) for a in eqn.invars)
    dims = {t.dim for k, t in tags if len(eqn.invars[k].aval.shape) == full}
    if len(dims) > 1:
        _refuse(eqn, tags[0][1], "its operands are streamed along different axes")
    tag = next(t for k, t in tags if len(eqn.invars[k].aval.shape) == full) if dims else tags[0][1]
    return Info(tag, phase)


def _reduction(eqn, tag: Tag, phase: int, crosses) -> Info:
    axes = tuple(eqn.params.get("axes", ()))
    name = eqn.primitive.name
    if tag.dim is None:
        if eqn.outvars[0].aval.shape != ():
            return Info(tag, phase)
        how = "only"
    elif tag.dim in axes:
        if name not in REDUCTIONS:
            _refuse(eqn, tag)
        how = REDUCTIONS[name]
    else:
        return Info(Tag(tag.group, tag.dim - sum(a < tag.dim for a in axes)), phase)
    if crosses is not None:
        crosses.append(Cross(eqn.outvars[0], tag.group, phase, how))
    return Info(None, phase + 1)


def _squeezed(eqn, tag: Tag) -> Tag:
    if tag.dim is None:
        return tag
    dims = tuple(eqn.params["dimensions"])
    if tag.dim in dims:
        _refuse(eqn, tag, "it squeezes that axis")
    return Tag(tag.group, tag.dim - sum(d < tag.dim for d in dims))


def _expanded(eqn, tag: Tag) -> Tag:
    if tag.dim is None:
        return tag
    dim = tag.dim
    for d in sorted(eqn.params["dimensions"]):
        if d <= dim:
            dim += 1
    return Tag(tag.group, dim)


def _reshaped(eqn, tag: Tag) -> Tag:
    if tag.dim is None:
        return tag
    old, new = eqn.invars[0].aval.shape, tuple(eqn.params["new_sizes"])
    if eqn.params.get("dimensions") or old[: tag.dim + 1] != new[: tag.dim + 1]:
        _refuse(eqn, tag, "it reshapes that axis into others")
    return tag


def _dot(eqn, ins: list[Info], phase: int, crosses) -> Info:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lt, rt = ins[0].tag, ins[1].tag
    tag = lt or rt
    if tag.dim is None:
        return Info(tag, phase)
    lhs_free = [d for d in range(len(eqn.invars[0].aval.shape)) if d not in lc and d not in lb]
    rhs_free = [d for d in range(len(eqn.invars[1].aval.shape)) if d not in rc and d not in rb]
    if lt is not None and lt.dim in lb and (rt is None or rt.dim == rb[lb.index(lt.dim)]):
        return Info(Tag(tag.group, lb.index(lt.dim)), phase)
    contracted = (lt is not None and lt.dim in lc) or (rt is not None and rt.dim in rc)
    if contracted and (lt is None or rt is None or lc.index(lt.dim) == rc.index(rt.dim)):
        if crosses is not None:
            crosses.append(Cross(eqn.outvars[0], tag.group, phase, "sum"))
        return Info(None, phase + 1)
    if lt is not None and rt is None and lt.dim in lhs_free:
        return Info(Tag(tag.group, len(lb) + lhs_free.index(lt.dim)), phase)
    if rt is not None and lt is None and rt.dim in rhs_free:
        return Info(Tag(tag.group, len(lb) + len(lhs_free) + rhs_free.index(rt.dim)), phase)
    _refuse(eqn, tag)
    raise AssertionError


def _branch_infos(eqn, ins: list[Info], crosses) -> list[Info]:
    outs = None
    for branch in eqn.params["branches"]:
        local: list = []
        inner = analyze(branch.jaxpr.eqns, dict(zip(branch.jaxpr.invars, ins[1:], strict=True)), local)
        if local:
            raise NotStreamableError("a lax.cond in the update reduces over a streamed axis inside a branch; zinfjax "
                                     "cannot split that into sweeps")
        got = [inner.get(v, UNTAGGED) if jx.is_var(v) else UNTAGGED for v in branch.jaxpr.outvars]
        outs = got if outs is None else [_join(a, b) for a, b in zip(outs, got, strict=True)]
    phase = max((i.phase for i in ins), default=0)
    return [Info(o.tag, max(o.phase, phase)) for o in outs]


def _join(a: Info, b: Info) -> Info:
    if a.tag is not None and b.tag is not None and a.tag != b.tag:
        raise NotStreamableError("the branches of a lax.cond in the update stream a value along different axes")
    return Info(a.tag or b.tag, max(a.phase, b.phase))


# ---- evaluation -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Window:
    """The part of a streamed group one unit holds: ``size`` entries from ``start`` of a streamed axis of ``full``."""

    start: int
    size: int
    full: int

    def cut(self, x, dim: int):
        """``x``'s window along ``dim`` when ``x`` spans the whole axis (a value that is the same for every unit)."""
        if dim is None or np.ndim(x) <= dim or np.shape(x)[dim] != self.full or self.full == self.size:
            return x
        return jax.lax.slice_in_dim(x, self.start, self.start + self.size, axis=dim)


class SlicedEvaluator:
    """Evaluates eqns for one unit: tagged values are the unit's slices, untagged values are whole.

    ``info`` is the analysis of the eqns (see `analyze`); ``window`` says which part of the streamed
    axis this unit holds; ``totals`` maps the outputs of cross eqns already combined to their
    value; ``partials`` collects, for cross eqns of this sweep, this unit's partial.
    """

    def __init__(self, info: dict, window: Window | None, totals: dict, sweep: int, group: str | None = None):
        self.info, self.window, self.totals, self.sweep, self.group = info, window, totals, sweep, group
        self.partials: dict = {}

    def tag(self, a) -> Tag | None:
        return self.info.get(a, UNTAGGED).tag if jx.is_var(a) else None

    def run(self, eqns, env: dict) -> dict:
        for eqn in eqns:
            known = [v for v in eqn.outvars if jx.is_var(v) and v in self.totals]
            if known:
                env.update({v: self.totals[v] for v in known})
                continue
            outs = self._eqn(eqn, env)
            for v, x in zip(eqn.outvars, outs, strict=True):
                if jx.is_var(v):
                    env[v] = x
        return env

    def as_tagged(self, x, tag: Tag | None):
        """``x`` cut to this unit's window where it is whole but should be a slice."""
        if tag is None or tag.dim is None or self.window is None:
            return x
        return self.window.cut(x, tag.dim)

    def _eqn(self, eqn, env: dict) -> list:
        if eqn.primitive.name == "cond":
            return self._cond(eqn, env)
        ins = [jx.read(env, a) for a in eqn.invars]
        out_tag = self.tag(eqn.outvars[0]) if eqn.outvars else None
        name = eqn.primitive.name
        cross_out = jx.is_var(eqn.outvars[0]) and self.info.get(eqn.outvars[0], UNTAGGED).tag is None and any(
            self.tag(a) is not None for a in eqn.invars)
        if cross_out and name != "cond" and name not in CALLS:
            return self._partial(eqn, ins)
        if all(self.tag(a) is None for a in eqn.invars):
            return self._bind(eqn, ins, eqn.params)
        ins = [self.as_tagged(x, out_tag if self.tag(a) is None and np.ndim(x) == len(eqn.outvars[0].aval.shape)
                              else None) for a, x in zip(eqn.invars, ins, strict=True)]
        if name in CALLS:
            body, consts = _sub(eqn)
            inner = self.__class__(analyze(body.eqns, {v: self.info.get(a, UNTAGGED) if jx.is_var(a) else UNTAGGED
                                                       for v, a in zip(body.invars, eqn.invars, strict=True)}),
                                   self.window, {}, self.sweep, self.group)
            sub_env = inner.run(body.eqns, dict(zip(body.constvars, consts, strict=True)) |
                                dict(zip(body.invars, ins, strict=True)))
            self.partials.update(inner.partials)
            return [jx.read(sub_env, v) for v in body.outvars]
        return self._bind(eqn, ins, self._params(eqn, ins))

    def _params(self, eqn, ins) -> dict:
        params = dict(eqn.params)
        name = eqn.primitive.name
        tag = self.tag(eqn.invars[0])
        if tag is None or tag.dim is None:
            return params
        size = np.shape(ins[0])[tag.dim]
        if name == "broadcast_in_dim":
            shape = list(params["shape"])
            shape[params["broadcast_dimensions"][tag.dim]] = size
            params["shape"] = tuple(shape)
        elif name == "reshape":
            new = list(params["new_sizes"])
            new[tag.dim] = size
            params["new_sizes"] = tuple(new)
        return params

    @staticmethod
    def _bind(eqn, ins, params) -> list:
        out = eqn.primitive.bind(*jx.one_memory(ins), **eqn.primitive.get_bind_params(params))
        return list(out) if eqn.primitive.multiple_results else [out]

    def _partial(self, eqn, ins) -> list:
        """A cross eqn of this sweep: this unit's partial, recorded, and a placeholder for its output."""
        phase = max((self.info.get(a, UNTAGGED).phase for a in eqn.invars if jx.is_var(a)), default=0)
        value = self._bind(eqn, ins, eqn.params)
        if phase == self.sweep:
            self.partials[eqn.outvars[0]] = value[0]
        return value

    def _cond(self, eqn, env: dict) -> list:
        """A cond for this unit: only the outputs of this unit's group (and untagged ones), from their operands."""
        wanted = [k for k, v in enumerate(eqn.outvars)
                  if self.tag(v) is None or self.group is None or self.tag(v).group == self.group]
        used = cond_operands(eqn, wanted)
        index = jx.read(env, eqn.invars[0])
        ops = [jx.read(env, eqn.invars[1 + j]) for j in used]
        op_info = [self.info.get(a, UNTAGGED) if jx.is_var(a) else UNTAGGED for a in eqn.invars[1:]]
        out_tags = [self.tag(eqn.outvars[k]) for k in wanted]

        def branch_fn(branch):
            def f(*xs):
                body = branch.jaxpr
                outs = [body.outvars[k] for k in wanted]
                eqns = jx.dce(body.eqns, outs)
                inner = self.__class__(analyze(eqns, dict(zip(body.invars, op_info, strict=True))), self.window, {},
                                       self.sweep, self.group)
                env = dict(zip(body.constvars, branch.consts, strict=True))
                env.update({body.invars[j]: x for j, x in zip(used, xs, strict=True)})
                env = inner.run(eqns, env)
                return [inner.as_tagged(jx.read(env, v), t) for v, t in zip(outs, out_tags, strict=True)]
            return f

        got = jax.lax.switch(index, [branch_fn(b) for b in eqn.params["branches"]], *ops)
        out = [None] * len(eqn.outvars)
        for k, x in zip(wanted, got, strict=True):
            out[k] = x
        return out


def cond_operands(eqn, outputs: list[int]) -> list[int]:
    """The operand positions (after the index) that a cond's ``outputs`` depend on, in any branch."""
    used: set[int] = set()
    for branch in eqn.params["branches"]:
        body = branch.jaxpr
        outs = [body.outvars[k] for k in outputs]
        free = set(jx.free_vars(jx.dce(body.eqns, outs))) | {v for v in outs if jx.is_var(v)}
        used.update(j for j, v in enumerate(body.invars) if v in free)
    return sorted(used)


def combine(how: str, parts: list):
    """The total of a cross eqn from its units' partials."""
    if how == "only":
        (value,) = parts
        return value
    ops = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "and": jnp.logical_and, "or": jnp.logical_or,
           "prod": jnp.multiply}
    total = parts[0]
    for p in parts[1:]:
        total = ops[how](total, p)
    return total
