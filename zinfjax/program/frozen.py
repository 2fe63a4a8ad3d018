"""Frozen leaves: those whose update is zero by construction, found in the traced update itself.

A leaf is frozen when the optimizer gives it no update whatever the gradient: ``optax.set_to_zero`` under
``optax.multi_transform`` (LoRA's base, `zinfjax.models.lora`; an ``nnx.Optimizer``'s ``wrt`` filter,
`zinfjax.trainers.frozen`), or any transformation whose traced update returns the parameter itself. The
test is symbolic, on `UpdatePlan`'s jaxpr: the new parameter must be the old one plus zeros (a zero literal,
broadcast, converted, or multiplied into anything) through adds, subtractions and same-type conversions,
the leaf must keep no optimizer state, and its gradient must count nowhere else (a global norm clipping every
leaf, masked ones included, reads it: that leaf is not frozen, as its gradient is still needed). Nothing is
evaluated, so a 1 GB leaf costs no more than a bias.

Example (adapters ``a`` trained beside weights ``w`` that ``set_to_zero`` freezes):
    >>> import jax, jax.numpy as jnp, optax
    >>> from zinfjax.program import UpdatePlan, program_for
    >>> def loss_fn(params, batch):               # three layers: a scan over their stacked weights
    ...     layer = lambda h, p: (jnp.tanh(h @ p["w"] + h @ p["a"]), None)
    ...     return jnp.mean(jax.lax.scan(layer, batch, params["blocks"])[0] ** 2)
    >>> params = {"blocks": {"w": jnp.ones((3, 8, 8)), "a": jnp.zeros((3, 8, 8))}}
    >>> program = program_for(loss_fn, params, jnp.ones((8, 8)))
    >>> tx = optax.multi_transform({"t": optax.adam(1e-3), "f": optax.set_to_zero()}, {"blocks": {"w": "f", "a": "t"}})
    >>> [program.leaves[k].path for k in sorted(frozen_leaves(UpdatePlan(tx, program)))]
    ['blocks/w']
"""

from __future__ import annotations

import numpy as np

from zinfjax.program import jaxpr as jx

ZERO, SAME, OTHER = "zero", "same", "other"
_PASS = {"convert_element_type", "copy", "copy_p", "reshape", "broadcast_in_dim", "squeeze", "expand_dims"}


def frozen_leaves(plan) -> frozenset[int]:
    """The indices of the program's leaves that ``plan``'s update leaves as they are (see the module docstring)."""
    jaxpr = plan.u_closed.jaxpr
    consts = dict(zip(jaxpr.constvars, plan.u_closed.consts, strict=True))
    read = {v for e in jx.dce(jaxpr.eqns, jaxpr.outvars) for v in e.invars if jx.is_var(v)} | set(jaxpr.outvars)
    out = set()
    for leaf in plan.program.leaves:
        k = leaf.index
        if leaf.group is None or plan.part_state(leaf.group, (k,)) or plan.u_grads[k] in read:
            continue  # keeps state, or its gradient counts elsewhere (a global norm over every leaf)
        if _kind(jaxpr.eqns, plan.u_new_params[k], plan.u_params[k], consts) == SAME:
            out.add(k)
    return frozenset(out)


def _kind(eqns, target, param, consts: dict) -> str:
    """Whether ``target`` is ``param`` itself (SAME), zeros (ZERO), or anything else (OTHER)."""
    made = {v: e for e in eqns for v in e.outvars if jx.is_var(v)}
    memo: dict = {}

    def kind(atom) -> str:
        if not jx.is_var(atom):
            return ZERO if np.all(np.asarray(atom.val) == 0) else OTHER
        if atom is param:
            return SAME
        if atom in consts:
            return ZERO if np.all(np.asarray(consts[atom]) == 0) else OTHER
        if atom not in memo:
            memo[atom] = _of(made.get(atom), kind, param)
        return memo[atom]

    return kind(target)


def _of(eqn, kind, param) -> str:
    if eqn is None or len(eqn.outvars) != 1:
        return OTHER
    name, args = eqn.primitive.name, [kind(a) for a in eqn.invars]
    if name in _PASS and len(args) == 1:
        same_shape = eqn.outvars[0].aval.shape == param.aval.shape and eqn.outvars[0].aval.dtype == param.aval.dtype
        return args[0] if args[0] == ZERO or same_shape else OTHER
    if name == "mul" and ZERO in args:
        return ZERO
    if name in ("add", "sub") and args.count(ZERO) == 1 and (args[0] if args[1] == ZERO else args[1]) == SAME:
        return SAME if name == "add" or args[1] == ZERO else OTHER
    if name in ("add", "sub") and args == [ZERO, ZERO]:
        return ZERO
    return OTHER
