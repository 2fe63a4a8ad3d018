"""The jitted functions of a program's stages: forward, and backward with recomputation or from saved residuals.

Every function works on all micro-batches of a step at once: a residual (and an activation)
carries a leading axis ``A`` of micro-batches, and each function loops over it with ``lax.map``,
so all micro-batches pass through layer ``i`` before layer ``i+1`` is read. Parameters are
shared by the micro-batches; the gradient a function returns is the mean of the micro-batches'
gradients, as the reference loop averages them.

A whole stage: ``fwd(params, ins) -> outs`` and ``bwd(params, ins, d_outs) -> (d_params, d_ins)``.
A scan iteration: ``fwd(params, slices, ins, carry, xs) -> (carry, ys)`` and
``bwd(params, slices, ins, carry, xs, d_carry, d_ys) -> (d_params, d_slices, d_ins, d_carry, d_xs)``.
A backward takes None for a cotangent that is not there and returns None for the cotangent of an
integer value (`without_float0`).
``params`` and ``slices`` map leaf indices to arrays; ``ins``/``outs`` are lists aligned with the
stage's residual variables. Backward functions recompute their forward inside the VJP
(activation checkpointing at stage and layer boundaries); the ``_saving`` forwards and ``_saved``
backwards instead keep the VJP's residuals from the forward (`zinfjax.program.residuals`).

Example (the forward of the first stage, the embedding, for one micro-batch):
    >>> from zinfjax.engine.placement import Placement
    >>> from zinfjax.program import program_for
    >>> from zinfjax.sharding import ShardingRules, make_mesh
    >>> def loss_fn(params, x):                   # an embedding, then 3 layers: a scan over stacked weights
    ...     layer = lambda h, w: (jnp.tanh(h @ w), None)
    ...     return jnp.mean(jax.lax.scan(layer, x @ params["embed"], params["blocks"])[0] ** 2)
    >>> params = {"blocks": jnp.ones((3, 8, 8)), "embed": jnp.ones((4, 8))}    # leaves 0 and 1
    >>> program, mesh = program_for(loss_fn, params, jnp.ones((2, 4))), make_mesh({"data": 1})
    >>> fns = StageFunctions(program, Placement(program, ShardingRules.for_mesh(mesh, 0), mesh))
    >>> stage = program.stages[0]
    >>> outs = fns.whole_fwd(stage.position)({1: params["embed"]}, [jnp.ones((1, 2, 4))])   # ins: (A, ...)
    >>> outs[0].shape, float(outs[0][0, 0, 0])     # x @ embed, for the 1 micro-batch
    ((1, 2, 8), 4.0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zinfjax.program import jaxpr as jx
from zinfjax.program.memo import instance_cache
from zinfjax.program.residuals import (
    Pullback,
    apply_saved,
    cotangents_for,
    of_differentiable,
    save_vjp,
    zero_cotangent,
)


def _mean0(tree):
    return jax.tree.map(lambda g: jnp.mean(g, axis=0), tree)


def without_float0(tree):
    """``tree`` with None for its float0 leaves (the cotangents of integer values, which are no gradient).

    A compiled function whose outputs are all arrays keeps JAX's C++ dispatch path; a float0 output
    (a numpy array made in Python on every call) sends each call down the slower Python path.
    """
    return jax.tree.map(lambda x: None if x.dtype == jax.dtypes.float0 else x, tree)


def vjp_of(f, primals: tuple, cotangents):
    """``f``'s VJP at ``primals`` for ``cotangents`` (None where there is none); inputs without a gradient get
    float0 zeros.

    ``primals`` is a tuple of pytrees; only inexact leaves are differentiated.
    """
    g, keep, flat, tree, diff = of_differentiable(f, primals)
    out, vjp = jax.vjp(g, *keep)
    cts = cotangents_for(cotangents, out)
    grads = iter(vjp(cts))
    full = [next(grads) if d else zero_cotangent(x) for x, d in zip(flat, diff, strict=True)]
    return jax.tree_util.tree_unflatten(tree, full)


class StageFunctions:
    """Builds (and caches) the jitted functions of a `Program`'s stages.

    ``placement`` says where values go: ``placement.params(leaf, x)`` constrains a parameter to
    its compute layout (ZeRO-3 gathers here), ``placement.grads(leaf, g)`` a gradient to its
    stage's gradient layout, ``placement.rows(x)`` a residual (``A`` leading) to its batch split.
    """

    def __init__(self, program, placement, micro: int = 1, frozen: frozenset = frozenset()):
        self.program, self.placement, self.micro = program, placement, micro
        self.frozen = frozen  # leaves whose weight gradient nobody needs (`UpdatePlan.frozen`): not differentiated
        self.constants = program.constants
        self._pullbacks: dict[tuple, Pullback] = {}

    def _map(self, f, xs):
        """``lax.map`` over the ``micro`` micro-batches (also when ``xs`` is empty: a stage of parameters only)."""
        return jax.lax.map(lambda args: f(args[1]), (jnp.arange(self.micro), xs))

    # ---- helpers -------------------------------------------------------------------------------

    def _params(self, params: dict) -> dict:
        return {k: self.placement.params(k, x) for k, x in params.items()}

    def _grads(self, grads: dict) -> dict:
        return {k: self.placement.grads(k, g) for k, g in grads.items()}

    def _split(self, params: dict) -> tuple[dict, dict]:
        """``(trainable, frozen)`` parts of ``{leaf: value}``: only the first is differentiated, so the backward
        computes no weight gradient of a frozen leaf (its input cotangents still flow)."""
        return ({k: x for k, x in params.items() if k not in self.frozen},
                {k: x for k, x in params.items() if k in self.frozen})

    def _split_scan(self, params: dict, slices: dict) -> tuple[dict, dict, dict, dict, list]:
        """`_split` of a stage's whole parameters and (a scan iteration's) slices, placed, and every one of them in
        the order a saved pullback finds its shared leaves (`zinfjax.program.residuals.save_vjp`)."""
        (train, fixed), (s_train, s_fixed) = self._split(self._params(params)), self._split(self._params(slices))
        return train, fixed, s_train, s_fixed, [*train.values(), *s_train.values(), *fixed.values(), *s_fixed.values()]

    def _rows(self, xs):
        return [self.placement.rows(x) for x in xs]

    # ---- whole stages --------------------------------------------------------------------------

    def _run_whole(self, stage, params: dict, ins: list) -> list:
        env = dict(self.constants)
        env.update({self.program.param_vars[k]: x for k, x in params.items()})
        env.update(zip(stage.inputs, ins, strict=True))
        env = jx.evaluate(stage.eqns, env)
        return [jx.read(env, v) for v in stage.outputs]

    @instance_cache  # one set of compiled functions per program, kept as long as it is
    def whole_fwd(self, position: int):
        stage = self._stage(position)

        def fwd(params, ins):
            params = self._params(params)
            return self._rows(self._map(lambda a: self._run_whole(stage, params, a), ins))

        return jax.jit(fwd)

    @instance_cache
    def whole_bwd(self, position: int):
        stage = self._stage(position)

        def bwd(params, ins, d_outs):
            params = self._params(params)

            train, fixed = self._split(params)

            def one(args):
                ins_a, d_a = args
                return vjp_of(lambda p, i: self._run_whole(stage, {**p, **fixed}, i), (train, ins_a), d_a)

            d_params, d_ins = self._map(one, (ins, d_outs))
            return without_float0((self._grads(_mean0(d_params)), self._rows(d_ins)))

        return jax.jit(bwd)

    # ---- scan iterations -----------------------------------------------------------------------

    def _operands(self, stage, params, slices, ins, carry, xs):
        """The body's inputs in order, for one micro-batch."""
        n_c, n_k = stage.num_consts, stage.num_carry
        ins_at = dict(zip(stage.const_vars, ins, strict=True))
        xs_it = iter(xs)
        consts, xs_ops = [], []
        for i, (kind, what) in enumerate(stage.operands):
            if n_c <= i < n_c + n_k:
                continue
            if kind == "var":
                value = ins_at[what] if i < n_c else next(xs_it)
            else:
                value = {"param": params, "stream": slices}[kind][what] if kind != "literal" else what
            (consts if i < n_c else xs_ops).append(value)
        return consts, list(carry), xs_ops

    def _run_body(self, stage, params, slices, ins, carry, xs):
        consts, carry, xs_ops = self._operands(stage, params, slices, ins, carry, xs)
        return jx.body_fn(stage.eqn)(consts, carry, xs_ops)

    @instance_cache
    def scan_fwd(self, position: int):
        stage = self._stage(position)

        def fwd(params, slices, ins, carry, xs):
            params, slices = self._params(params), self._params(slices)

            def one(args):
                ins_a, carry_a, xs_a = args
                return self._run_body(stage, params, slices, ins_a, carry_a, xs_a)

            carry, ys = self._map(one, (ins, carry, xs))
            return self._rows(carry), self._rows(ys)

        return jax.jit(fwd)

    @instance_cache
    def scan_bwd(self, position: int):
        stage = self._stage(position)

        def bwd(params, slices, ins, carry, xs, d_carry, d_ys):
            train, fixed, s_train, s_fixed, _ = self._split_scan(params, slices)

            def one(args):
                ins_a, carry_a, xs_a, dc_a, dy_a = args

                def f(p, s, i, c, x):
                    return self._run_body(stage, {**p, **fixed}, {**s, **s_fixed}, i, c, x)

                return vjp_of(f, (train, s_train, ins_a, carry_a, xs_a), (dc_a, dy_a))

            d_params, d_slices, d_ins, d_carry, d_xs = self._map(one, (ins, carry, xs, d_carry, d_ys))
            return without_float0((self._grads(_mean0(d_params)), self._grads(_mean0(d_slices)), self._rows(d_ins),
                                   self._rows(d_carry), self._rows(d_xs)))

        return jax.jit(bwd)

    # ---- saved residuals: backward without recomputation (zinfjax.program.residuals) ----------

    def _pullback(self, key: tuple) -> Pullback:
        return self._pullbacks.setdefault(key, Pullback())

    @instance_cache
    def whole_fwd_saving(self, position: int):
        """``fwd(params, ins) -> (outs, kept)``: `whole_fwd`, and the residuals `whole_bwd_saved` takes."""
        stage, pullback = self._stage(position), self._pullback(("whole", position))

        def fwd(params, ins):
            train, fixed, _, _, shared = self._split_scan(params, {})

            def one(ins_a):
                return save_vjp(lambda p, i: self._run_whole(stage, {**p, **fixed}, i), (train, ins_a), shared,
                                pullback)

            outs, kept = self._map(one, ins)
            return self._rows(outs), kept

        return jax.jit(fwd)

    @instance_cache
    def whole_bwd_saved(self, position: int):
        """``bwd(params, kept, d_outs) -> (d_params, d_ins)``: `whole_bwd` from saved residuals."""
        pullback = self._pullback(("whole", position))

        def bwd(params, kept, d_outs):
            *_, shared = self._split_scan(params, {})
            d_params, d_ins = self._map(lambda a: apply_saved(pullback, a[0], shared, a[1]), (kept, d_outs))
            return without_float0((self._grads(_mean0(d_params)), self._rows(d_ins)))

        return jax.jit(bwd)

    @instance_cache
    def scan_fwd_saving(self, position: int):
        """``fwd(params, slices, ins, carry, xs) -> (carry, ys, kept)``: `scan_fwd` and its residuals."""
        stage, pullback = self._stage(position), self._pullback(("scan", position))

        def fwd(params, slices, ins, carry, xs):
            train, fixed, s_train, s_fixed, shared = self._split_scan(params, slices)

            def one(args):
                def f(p, s, i, c, x):
                    return self._run_body(stage, {**p, **fixed}, {**s, **s_fixed}, i, c, x)

                (carry_a, ys_a), kept = save_vjp(f, (train, s_train, *args), shared, pullback)
                return carry_a, ys_a, kept

            carry, ys, kept = self._map(one, (ins, carry, xs))
            return self._rows(carry), self._rows(ys), kept

        return jax.jit(fwd)

    @instance_cache
    def scan_bwd_saved(self, position: int):
        """``bwd(params, slices, kept, d_carry, d_ys)``: `scan_bwd` from saved residuals, same outputs."""
        pullback = self._pullback(("scan", position))

        def bwd(params, slices, kept, d_carry, d_ys):
            *_, shared = self._split_scan(params, slices)
            d_params, d_slices, d_ins, d_carry, d_xs = self._map(
                lambda a: apply_saved(pullback, a[0], shared, (a[1], a[2])), (kept, d_carry, d_ys))
            return without_float0((self._grads(_mean0(d_params)), self._grads(_mean0(d_slices)), self._rows(d_ins),
                                   self._rows(d_carry), self._rows(d_xs)))

        return jax.jit(bwd)

    @instance_cache
    def body_fns(self, position: int) -> StageFunctions:
        """The stage functions of the body of the nested scan at ``position`` (`zinfjax.program.nested.Body`)."""
        return StageFunctions(self._stage(position).body, self.placement, self.micro)

    def _stage(self, position: int):
        return next(s for s in self.program.stages if s.position == position)


class NoPlacement:
    """Placement for one device: nothing to constrain."""

    def params(self, leaf: int, x):
        return x

    def grads(self, leaf: int, g):
        return g

    def rows(self, x):
        return x
