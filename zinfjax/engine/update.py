"""The optimizer step on one layer's slice: any elementwise optax transformation.

ZeRO-Infinity updates each layer as soon as its gradient exists, with its fp32 master
weights and optimizer state streamed from the optimizer tier. That is exact only when
the transformation is elementwise per leaf (adam, adamw, lion, sgd with momentum,
adagrad, and their schedules); `check_elementwise` refuses any other before training.
Global-norm clipping is done by the engine itself from ``Config.grad_clip``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zinfjax.engine.functions import Layout
from zinfjax.errors import UserError


class NotElementwiseError(UserError):
    """The optax transformation couples leaves, so it cannot be applied one layer at a time."""


def _probe_trees():
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    grads = [{k: (100.0 * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}
             for _ in range(3)]
    return params, grads


def _run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def check_elementwise(tx: optax.GradientTransformation) -> None:
    """Refuses a transformation whose update of one leaf depends on another leaf.

    It runs three steps on a two-leaf tree, whole and leaf by leaf, with large gradients
    (so that clipping by global norm, if present, triggers), and compares.

    Example:
        >>> check_elementwise(optax.adamw(1e-3))                                    # fine
        >>> check_elementwise(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))  # raises
    """
    params, grads = _probe_trees()
    whole = _run(tx, params, grads)
    for key in params:
        part = _run(tx, {key: params[key]}, [{key: g[key]} for g in grads])
        if not np.allclose(part[key], whole[key], rtol=1e-5, atol=1e-7):
            raise NotElementwiseError(
                "the optax transformation is not elementwise per leaf (for example it clips by global norm "
                "or normalises across leaves), so zinfjax cannot apply it one layer at a time; remove "
                "optax.clip_by_global_norm and set Config.grad_clip instead, or use an elementwise optimizer "
                "such as adamw, adam, lion, sgd or adagrad"
            )


@functools.lru_cache(maxsize=64)
def make_update(tx: optax.GradientTransformation, compute_dtype, layout: Layout, group: str) -> callable:
    """A jitted ``update(master, grads, opt_state, g_norm, max_norm, grad_div) -> (compute, master, opt)``.

    Gradients are first divided by ``grad_div`` (the fp16 loss scale, else 1), then clipped
    exactly as ``optax.clip_by_global_norm(max_norm)`` would, given the global ``g_norm``
    (``max_norm = inf`` turns clipping off), then passed to ``tx``.

    It runs on the optimizer state's shards (``layout``, for one layer of ``group``): from
    stage 1 on, each device updates only its slice of the master weights and gradients,
    and the new compute copy is all-gathered into the parameters' layout on the way out.

    Example:
        >>> update = make_update(optax.adamw(1e-3), jnp.float32, layout, "blocks")
        >>> compute, master, opt = update(master, grads, opt, g_norm, jnp.float32(jnp.inf), jnp.float32(1))
    """
    rules, mesh = layout.rules, layout.mesh

    def place(tree, kind):
        return jax.lax.with_sharding_constraint(tree, rules.shardings(mesh, kind, group, tree))

    def update(master, grads, opt_state, g_norm, max_norm, grad_div):
        master, grads, opt_state = place(master, "master"), place(grads, "master"), place(opt_state, "opt")
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / grad_div, grads)
        keep = g_norm < max_norm
        grads = jax.tree.map(lambda t: jax.lax.select(keep, t, (t / g_norm.astype(t.dtype)) * max_norm), grads)
        updates, opt_state = tx.update(grads, opt_state, master)
        master = optax.apply_updates(master, updates)
        compute = jax.tree.map(lambda x: x.astype(compute_dtype), master)
        return place(compute, "params"), place(master, "master"), place(opt_state, "opt")

    return jax.jit(update)


@jax.jit
def spool_grads(grads):
    """Gradients to spool as float32, and their sum of squares: one part of the global norm's square."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return grads, sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
