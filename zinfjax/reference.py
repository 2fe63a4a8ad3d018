"""The reference trainer: a plain in-memory jitted optax step, data-parallel over a mesh.

It is the numerical oracle for every engine, stage and tier (DESIGN.md, invariant 1),
so it stays simple and obviously right: params and optimizer state replicated, the batch
split over the ``data`` axis, gradients averaged over micro-batches.

Example:
    >>> step = make_step(model.layers(), tx, mesh, grad_accum=2)
    >>> params, opt_state, loss = step(params, opt_state, batch)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from zinfjax.models.layered import Layers, loss_fn
from zinfjax.sharding import batch_sharding, replicated


def micro_batches(batch: jax.Array, grad_accum: int) -> jax.Array:
    """(B, T+1) -> (grad_accum, B / grad_accum, T+1): micro-batch ``k`` is rows ``k::grad_accum``.

    Striding keeps every micro-batch spread evenly over the data axis.
    """
    b = batch.shape[0]
    return batch.reshape(b // grad_accum, grad_accum, -1).swapaxes(0, 1)


def loss_and_grads(layers: Layers, params, batch: jax.Array, grad_accum: int = 1):
    """Mean loss and mean gradients over ``grad_accum`` micro-batches of ``batch``."""

    def one(tokens):
        return jax.value_and_grad(lambda p: loss_fn(layers, p, tokens[:, :-1], tokens[:, 1:]))(params)

    losses, grads = jax.lax.map(one, micro_batches(batch, grad_accum))
    return jnp.mean(losses), jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)


def make_step(layers: Layers, tx: optax.GradientTransformation, mesh: Mesh, grad_accum: int = 1) -> Callable:
    """A jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)``."""

    def step(params, opt_state, batch):
        loss, grads = loss_and_grads(layers, params, batch, grad_accum)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rep, data = replicated(mesh), batch_sharding(mesh)
    return jax.jit(step, in_shardings=(rep, rep, data), out_shardings=(rep, rep, rep), donate_argnums=(0, 1))


def init_state(model, tx: optax.GradientTransformation, mesh: Mesh, seed: int, seq_len: int):
    """Initial params and optimizer state, replicated on the mesh."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    rep = replicated(mesh)
    params = jax.jit(lambda key: model.init(key, tokens)["params"], out_shardings=rep)(jax.random.key(seed))
    return params, jax.jit(tx.init, out_shardings=rep)(params)
