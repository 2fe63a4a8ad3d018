"""Backward passes from saved residuals: a stage's forward keeps what its VJP needs, so its backward need not rerun it.

`save_vjp` runs ``f`` and returns, beside its outputs, the flat leaves of its VJP (``jax.vjp``'s pullback is
a pytree of residual arrays). Only activations are kept:

- the ``shared`` inputs are left out by identity: a layer's parameters, which its backward reads
  again anyway;
- of the values ``f`` computes, only the outputs of matrix products (`is_product`) are kept; the rest
  (layer norms, softmax, activation functions, casts, transposes) is recomputed from them in the
  backward (``jax.checkpoint`` with a saving policy). That costs a little elementwise work and keeps
  a third of what saving everything would (gpt2-small, batch 4 x 128: 31 against 63 MB a layer), and
  a tied head's transposed embedding is never kept.

`Pullback` records, at trace time, how to rebuild the pullback from kept leaves and shared inputs;
`apply_saved` runs it. The backward then costs the VJP alone, the same as rerunning the forward
inside ``jax.vjp`` up to XLA's rounding (tests/engine/test_residuals.py).

Example:
    >>> import jax.numpy as jnp
    >>> pb = Pullback()
    >>> w = jnp.ones((2, 2))
    >>> out, kept = save_vjp(lambda w, x: jnp.tanh(x @ w), (w, jnp.ones((1, 2))), [w], pb)
    >>> [g.shape for g in apply_saved(pb, kept, [w], jnp.ones((1, 2)))]
    [(2, 2), (1, 2)]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.program import jaxpr as jx

# The primitive whose outputs a saved backward keeps; everything else it recomputes from them.
PRODUCT = "dot_general"


def is_product(name: str, params: dict) -> bool:
    """Whether an eqn of primitive ``name`` computes a matrix product: ``dot_general``, or a call with a
    VJP of its own around one (``custom_vjp_call``, as zinfjax.models.products' low-precision product)."""
    if name == PRODUCT:
        return True
    body = params.get("call_jaxpr") if name == "custom_vjp_call" else None
    return body is not None and any(e.primitive.name == PRODUCT for e in body.jaxpr.eqns)


def keep_products(prim, *_, **params) -> bool:
    """``jax.checkpoint``'s policy: keep the outputs of matrix products (`is_product`)."""
    return is_product(prim.name, params)


def differentiable(aval) -> bool:
    """Whether values of ``aval`` carry a gradient (inexact dtypes)."""
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def zero_cotangent(x):
    """The cotangent of a value that has none: zeros, float0 for integer and key values."""
    if differentiable(jax.typeof(x) if not hasattr(x, "aval") else x.aval):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def cotangent_for(c, out):
    """The cotangent a VJP takes for the output ``out`` (a value or an aval): ``c``, where ``out`` carries a
    gradient and ``c`` is given; zeros where ``c`` is None (no cotangent); float0 zeros where ``out`` has no
    gradient."""
    if not differentiable(out if isinstance(out, jax.ShapeDtypeStruct) else jax.typeof(out)):
        return np.zeros(np.shape(out), jax.dtypes.float0)
    return jnp.zeros(np.shape(out), out.dtype) if c is None else c


def cotangents_for(cotangents, outs):
    """`cotangent_for` over a tree of cotangents (None where there is none) and the outputs' tree."""
    return jax.tree.map(cotangent_for, cotangents, outs, is_leaf=lambda x: x is None)


class Pullback:
    """What `save_vjp` learnt while tracing: the pullback's structure, which of its leaves are shared inputs,
    and the avals of the primals and outputs, so `apply_saved` can rebuild it in another function."""

    def __init__(self):
        self.tree = None


def of_differentiable(f, primals: tuple):
    """``f`` as a function of the inexact leaves of ``primals`` alone (the others held fixed): ``(g, those
    leaves, all leaves, their tree, which are inexact)``; `save_vjp` and the recomputing VJP both take it."""
    flat, tree = jax.tree_util.tree_flatten(primals)
    diff = [differentiable(jax.typeof(x)) for x in flat]

    def g(*kept):
        it = iter(kept)
        full = [next(it) if d else x for x, d in zip(flat, diff, strict=True)]
        return f(*jax.tree_util.tree_unflatten(tree, full))

    return g, [x for x, d in zip(flat, diff, strict=True) if d], flat, tree, diff


def save_vjp(f, primals: tuple, shared: list, pullback: Pullback):
    """``f(*primals)`` and the leaves of its pullback that are not in ``shared``; fills ``pullback``.

    ``primals`` is a tuple of pytrees; only inexact leaves are differentiated.
    """
    g, keep, flat, tree, diff = of_differentiable(f, primals)
    out, vjp = jax.vjp(jax.checkpoint(g, policy=keep_products), *keep)
    leaves, pullback.tree = jax.tree_util.tree_flatten(vjp)
    pullback.refs = [next((j for j, s in enumerate(shared) if leaf is s), None) for leaf in leaves]
    pullback.primals = (tree, diff, [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in flat])
    pullback.outs = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype), out)
    return out, [leaf for leaf, r in zip(leaves, pullback.refs, strict=True) if r is None]


def apply_saved(pullback: Pullback, kept: list, shared: list, cotangents):
    """The VJP `save_vjp` saved, at ``cotangents`` (None where there is none): gradients shaped like its primals
    (float0 zeros where none)."""
    it = iter(kept)
    leaves = [shared[r] if r is not None else next(it) for r in pullback.refs]
    vjp = jax.tree_util.tree_unflatten(pullback.tree, leaves)
    cts = cotangents_for(cotangents, pullback.outs)
    grads = iter(vjp(cts))
    tree, diff, avals = pullback.primals
    full = [next(grads) if d else np.zeros(a.shape, jax.dtypes.float0) for a, d in zip(avals, diff, strict=True)]
    return jax.tree_util.tree_unflatten(tree, full)


def residual_bytes(program, micro: int) -> int:
    """What one step's saved residuals hold at most, over the whole batch: each whole stage's and each
    scan iteration's kept products and non-parameter inputs, for ``micro`` micro-batches.

    Example:
        >>> from zinfjax.program import program_for
        >>> def loss(p, b):
        ...     return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b, p["w"])[0])
        >>> residual_bytes(program_for(loss, {"w": jnp.ones((3, 8, 8))}, jnp.ones((4, 8))), micro=2)
        1792

        Per micro-batch: each of the 3 layers keeps its product and its input (4 x 8 float32, 128 bytes each), and
        the sum after the scan its input: 7 x 128 bytes.
    """
    total = 0
    for stage in program.stages:
        if stage.kind == "scan":
            body = stage.eqn.params["jaxpr"].jaxpr
            inputs = [v for v, (kind, _) in list(zip(body.invars, stage.operands, strict=True))[stage.num_consts:]
                      if kind not in ("param", "stream")]  # the carry and this iteration's xs, not its parameters
            total += stage.length * (jx.output_bytes(body.eqns, is_product) + jx.nbytes(v.aval for v in inputs))
            total += jx.nbytes(v.aval for v in stage.const_vars)
        else:
            total += jx.output_bytes(stage.eqns, is_product) + jx.nbytes(v.aval for v in stage.inputs)
    return micro * total
