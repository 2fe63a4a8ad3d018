"""Small tools over jaxprs: trace a function, inline the calls that hide a scan, drop dead code, evaluate.

zinfjax reads a user's function (a loss, an initialiser, an optimizer update) as a jaxpr and runs
pieces of it: the part before a scan, one iteration of the scan, the part after. These helpers are
the only place that touches JAX's jaxpr internals, so a JAX upgrade changes one module
(docs/design.md, "Versions").

Example:
    >>> closed, out_tree = trace(lambda x: x * 2.0, 1.0)
    >>> evaluate(closed.jaxpr.eqns, {closed.jaxpr.invars[0]: 3.0})[closed.jaxpr.outvars[0]]
    Array(6., dtype=float32, weak_type=True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import jax
import jax.extend.core as jc
import jax.extend.core.primitives as prims
import numpy as np

# Call primitives whose body is inlined when it hides a scan: jit, remat and closed calls.
CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
SCAN = "scan"


def trace(fn, *args):
    """``fn``'s closed jaxpr on ``args`` (arrays or ``ShapeDtypeStruct``s), and the tree of its outputs.

    Example:
        >>> closed, out_tree = trace(lambda p: {"y": p["w"] * 2}, {"w": 1.0})
        >>> out_tree
        PyTreeDef({'y': *})
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    return closed, jax.tree_util.tree_structure(shapes)


def is_var(atom) -> bool:
    """Whether ``atom`` is a variable (not a literal, not a dropped output)."""
    return isinstance(atom, jc.Var) and not isinstance(atom, jc.DropVar)


def read(env: dict, atom):
    """The value of ``atom`` in ``env``: a literal's own value, else the variable's."""
    return atom.val if isinstance(atom, jc.Literal) else env[atom]


def one_memory(ins: list) -> list:
    """``ins`` in one memory space: when some are in host memory (the update on the host), the rest
    (a constant of the optimizer, a broadcast literal) join them there. A primitive bound directly
    takes no mix of spaces, where ``jnp`` would have moved its operands itself.

    Example:
        >>> one_memory([1.0, np.float32(2)])
        [1.0, np.float32(2.0)]
    """
    host = jax.memory.Space.Host
    spaces = [getattr(jax.typeof(x), "memory_space", None) if isinstance(x, jax.Array | jax.core.Tracer) else None
              for x in ins]
    if host not in spaces or all(s in (host, None) for s in spaces):
        return ins
    return [jax.device_put(x, host) if s not in (host, None) else x for x, s in zip(ins, spaces, strict=True)]


def evaluate(eqns: Iterable, env: dict) -> dict:
    """Runs ``eqns`` in order over ``env`` (variable -> value), adding their outputs; returns ``env``.

    Works on concrete arrays and under tracing (jit, vjp), like ``jax.core.eval_jaxpr``.
    """
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        out = eqn.primitive.bind(*[read(env, a) for a in eqn.invars], **params)
        outs = out if eqn.primitive.multiple_results else [out]
        for var, value in zip(eqn.outvars, outs, strict=True):
            if is_var(var):
                env[var] = value
    return env


def sub_jaxpr(eqn, names=CALLS):
    """The body of a call eqn (a primitive in ``names``) as ``(Jaxpr, consts)``, or None."""
    if eqn.primitive.name not in names:
        return None
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if body is None:
        return None
    if isinstance(body, jc.ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    return body, []


def contains(jaxpr, name: str) -> bool:
    """Whether ``jaxpr`` holds an eqn of primitive ``name``, at any depth of calls."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return True
        sub = sub_jaxpr(eqn)
        if sub is not None and contains(sub[0], name):
            return True
    return False


def inline_calls(closed, keep=lambda jaxpr: not contains(jaxpr, SCAN), names=CALLS, conds: bool = False):
    """A closed jaxpr whose call eqns (primitives in ``names``) are replaced by their bodies, unless ``keep`` says.

    By default every call that hides a scan is inlined, so the scans of a jitted or rematerialised
    model show at the top level. Inlined variables are renamed, so a body called twice stays apart.
    With ``conds``, every ``cond`` becomes straight-line code: all its branches, then a ``select_n``
    of their outputs by the (clamped) index. That computes the branches not taken too, which is
    harmless for pure code and makes a cond over a whole tree separable leaf by leaf.
    """
    return _Inliner(closed, keep, names, conds).run()


class _Inliner:
    """`inline_calls`' state: the outer jaxpr's constants and equations so far, and the renaming of inlined
    variables to outer atoms."""

    def __init__(self, closed, keep, names, conds: bool):
        self.closed, self.keep, self.names, self.conds = closed, keep, names, conds
        self.constvars, self.consts, self.eqns = list(closed.jaxpr.constvars), list(closed.consts), []
        self.mapping: dict = {}

    def run(self):
        jaxpr = self.closed.jaxpr
        self.emit(jaxpr)
        new = jc.Jaxpr(self.constvars, list(jaxpr.invars), [self.atom(a) for a in jaxpr.outvars], self.eqns,
                       jaxpr.effects, jaxpr.debug_info)
        return jc.ClosedJaxpr(new, self.consts)

    def atom(self, a):
        return self.mapping.get(a, a) if is_var(a) else a

    def emit(self, jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if self.conds and eqn.primitive.name == "cond" and not eqn.effects:
                self.expand(eqn)
                continue
            sub = sub_jaxpr(eqn, self.names)
            if sub is None or self.keep(sub[0]):
                outvars = [_fresh(v, self.mapping) for v in eqn.outvars]
                self.eqns.append(eqn.replace(invars=[self.atom(a) for a in eqn.invars], outvars=outvars))
                continue
            outs = self.body(*sub, [self.atom(a) for a in eqn.invars])
            for var, out in zip(eqn.outvars, outs, strict=True):
                if is_var(var):
                    self.mapping[var] = out

    def body(self, jaxpr, consts, args) -> list:
        """Emits ``jaxpr`` on ``args`` (outer atoms); returns its outputs as outer atoms."""
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            fresh = jc.Var(var.aval)
            self.constvars.append(fresh)
            self.consts.append(value)
            self.mapping[var] = fresh
        for var, a in zip(jaxpr.invars, args, strict=True):
            self.mapping[var] = a
        self.emit(jaxpr)
        return [self.atom(a) for a in jaxpr.outvars]

    def expand(self, eqn) -> None:
        """A ``cond`` as straight-line code: every branch, then a ``select_n`` of their outputs by the index."""
        branches = eqn.params["branches"]
        index, *ops = [self.atom(a) for a in eqn.invars]
        outs = [self.body(b.jaxpr, b.consts, ops) for b in branches]
        idx = jc.Var(index.aval) if is_var(index) or len(branches) > 1 else index
        if len(branches) > 1:
            lo, hi = (jc.Literal(np.array(v, index.aval.dtype), index.aval) for v in (0, len(branches) - 1))
            self.eqns.append(jc.new_jaxpr_eqn([lo, index, hi], [idx], prims.clamp_p, {}, jc.no_effects))
        for k, out in enumerate(eqn.outvars):
            if not is_var(out):
                continue
            cases = [o[k] for o in outs]
            if len(cases) == 1:
                self.mapping[out] = cases[0]
                continue
            fresh = jc.Var(out.aval)
            self.mapping[out] = fresh
            self.eqns.append(jc.new_jaxpr_eqn([idx, *cases], [fresh], prims.select_n_p, {}, jc.no_effects))


def _fresh(var, mapping: dict):
    """A new variable for an eqn's output (the same eqn may be inlined more than once)."""
    if not is_var(var):
        return var
    fresh = jc.Var(var.aval)
    mapping[var] = fresh
    return fresh


def placeholder():
    """A fresh float32 scalar variable that no eqn defines: a stand-in where a list of variables needs an entry
    for a value that is not there (a parameter a scan's body does not hold)."""
    return jc.Var(jax.core.ShapedArray((), np.float32))


def dce(eqns: Sequence, needed: Iterable) -> list:
    """The eqns that ``needed`` variables depend on, in order; effectful eqns are kept."""
    live = {a for a in needed if is_var(a)}
    kept = []
    for eqn in reversed(eqns):
        if eqn.effects or any(v in live for v in eqn.outvars if is_var(v)):
            kept.append(eqn)
            live.update(a for a in eqn.invars if is_var(a))
    return kept[::-1]


def free_vars(eqns: Sequence) -> list:
    """The variables ``eqns`` read but do not define, in first-use order."""
    defined, free, seen = set(), [], set()
    for eqn in eqns:
        for a in eqn.invars:
            if is_var(a) and a not in defined and a not in seen:
                free.append(a)
                seen.add(a)
        defined.update(v for v in eqn.outvars if is_var(v))
    return free


def consumers(eqns: Sequence) -> dict:
    """For every variable, the indices of the eqns that read it."""
    out: dict = {}
    for k, eqn in enumerate(eqns):
        for a in eqn.invars:
            if is_var(a):
                out.setdefault(a, []).append(k)
    return out


def scan_parts(eqn) -> tuple[list, list, list]:
    """A scan eqn's operands split as ``(consts, carry, xs)``."""
    nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
    ops = list(eqn.invars)
    return ops[:nc], ops[nc : nc + nk], ops[nc + nk :]


def body_fn(eqn):
    """One iteration of a scan eqn: ``f(consts, carry, x) -> (carry, y)``, lists of values."""
    body = eqn.params["jaxpr"]
    nk = eqn.params["num_carry"]

    def f(consts, carry, xs):
        out = jax.core.eval_jaxpr(body.jaxpr, body.consts, *consts, *carry, *xs)
        return list(out[:nk]), list(out[nk:])

    return f


def nbytes(avals: Iterable) -> int:
    """Bytes of values of ``avals`` (avals without a shape, such as tokens, count none)."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals if hasattr(a, "shape"))  # PRNG keys too


def output_bytes(eqns: Iterable, kept: Callable[[str, dict], bool]) -> int:
    """Bytes of the outputs of the eqns for which ``kept(primitive name, params)`` holds in ``eqns``, and,
    where it does not, through the bodies of calls.

    Example:
        >>> closed, _ = trace(lambda a: (a @ a) @ a, np.ones((4, 4), np.float32))
        >>> output_bytes(closed.jaxpr.eqns, lambda name, params: name == "dot_general")
        128
    """
    total = 0
    for eqn in eqns:
        if kept(eqn.primitive.name, eqn.params):
            total += nbytes(v.aval for v in eqn.outvars)
            continue
        subs = [p.jaxpr if isinstance(p, jc.ClosedJaxpr) else p for p in eqn.params.values()
                if isinstance(p, jc.ClosedJaxpr | jc.Jaxpr)]
        total += sum(output_bytes(sub.eqns, kept) for sub in subs)
    return total
