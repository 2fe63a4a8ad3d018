"""The reference trainer: a plain in-memory jitted optax step, data-parallel over a mesh.

It is the numerical oracle for every engine, stage and tier (docs/design.md, invariant 1), so
it stays simple and obviously right: params and optimizer state replicated, the batch split over
the ``data`` axis, gradients averaged over micro-batches.

Example:
    >>> from zinfjax.sharding import make_mesh
    >>> def loss_fn(params, batch):                 # any loss of params and a batch, batch axis first
    ...     return jnp.mean((batch @ params["w"]) ** 2)
    >>> tx, mesh = optax.sgd(0.1), make_mesh({"data": 1})
    >>> params, opt_state = init_state(lambda rng: {"w": jnp.ones((4, 2))}, tx, mesh, seed=0)
    >>> step = make_step(loss_fn, tx, mesh, grad_accum=2)
    >>> params, opt_state, loss = step(params, opt_state, jnp.ones((8, 4)) / 4)
    >>> float(loss), round(float(params["w"][0, 0]), 6)   # each weight's gradient is 1/4: down by 0.1 x 1/4
    (1.0, 0.975)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from zinfjax.checkpoint.model import start_checkpoint
from zinfjax.checkpoint.restore import start_params
from zinfjax.config import Config
from zinfjax.data import Batches, global_batch
from zinfjax.models.stacked import lm_init, lm_loss, takes_rng
from zinfjax.sharding import batch_sharding, replicated
from zinfjax.trainers.optimizers import make_optimizer


def micro_batches(batch, grad_accum: int):
    """Each leaf ``(B, ...) -> (grad_accum, B / grad_accum, ...)``: micro-batch ``k`` is rows ``k::grad_accum``.

    Striding keeps every micro-batch spread evenly over the data axis.

    Example:
        >>> micro_batches(jnp.arange(8).reshape(4, 2), 2)[0]
        Array([[0, 1],
               [4, 5]], dtype=int32)
    """

    def one(x):
        b = x.shape[0]
        return x.reshape(b // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(one, batch)


def loss_and_grads(loss_fn, params, batch, grad_accum: int = 1, rng=None):
    """Mean loss and mean gradients of ``loss_fn(params, micro_batch[, key])`` over ``grad_accum`` micro-batches;
    with ``rng``, micro-batch ``a`` takes ``fold_in(rng, a)`` (``rng`` itself when there is one), as the engine's."""
    micro = micro_batches(batch, grad_accum)
    if rng is None:
        losses, grads = jax.lax.map(lambda b: jax.value_and_grad(loss_fn)(params, b), micro)
    else:
        keys = rng[None] if grad_accum == 1 else jax.vmap(lambda a: jax.random.fold_in(rng, a))(jnp.arange(grad_accum))
        losses, grads = jax.lax.map(lambda bk: jax.value_and_grad(loss_fn)(params, *bk), (micro, keys))
    return jnp.mean(losses), jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)


def make_step(loss_fn, tx: optax.GradientTransformation, mesh: Mesh, grad_accum: int = 1,
              with_rng: bool = False) -> Callable:
    """A jitted ``step(params, opt_state, batch[, rng]) -> (params, opt_state, loss)``."""

    def step(params, opt_state, batch, rng=None):
        loss, grads = loss_and_grads(loss_fn, params, batch, grad_accum, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rep, data = replicated(mesh), batch_sharding(mesh)
    shardings = (rep, rep, data, rep) if with_rng else (rep, rep, data)
    return jax.jit(step, in_shardings=shardings, out_shardings=(rep, rep, rep), donate_argnums=(0, 1))


def init_state(init_fn, tx: optax.GradientTransformation, mesh: Mesh, seed: int):
    """Initial params (``init_fn(jax.random.key(seed))``) and optimizer state, replicated on the mesh."""
    rep = replicated(mesh)
    params = jax.jit(init_fn, out_shardings=rep)(jax.random.key(seed))
    return params, jax.jit(tx.init, out_shardings=rep)(params)


class ReferenceTrainer:
    """The in-memory reference trainer behind a ``step(batch) -> metrics`` interface.

    Its step keeps each block's matrix products for the backward and recomputes the rest
    (``StackedLM.save_products``), as the engine's saved residuals do: the plain loop's arithmetic, up to
    the rounding of the recomputed values, without stacking every intermediate of every layer.
    """

    engine = None  # nothing streams
    restored = None  # a plain run starts afresh (``resume`` streams)

    def __init__(self, config: Config, model, mesh):
        self.tx = make_optimizer(config)
        self.mesh = mesh
        self.params, self.opt_state = init_state(lm_init(model), self.tx, mesh, config.seed)
        start = start_checkpoint(config.model)  # model=<checkpoint>: its parameters, adapters made afresh
        if start is not None:
            self.params = jax.device_put(start_params(start, self.params), replicated(mesh))
        self.loss = lm_loss(model.clone(save_products=True))
        self._with_rng, self._seed, self._count = takes_rng(model), config.seed, 0
        self._step = make_step(self.loss, self.tx, mesh, config.grad_accum, self._with_rng)

    def next_batch(self, batches: Batches) -> jax.Array:
        return global_batch(batches, batch_sharding(self.mesh))

    def step(self, batch) -> dict:
        batch = jax.device_put(batch, batch_sharding(self.mesh))
        self._count += 1  # the step's key, as the engine's: fold_in(key(seed), step)
        rng = (jax.random.fold_in(jax.random.key(self._seed), self._count),) if self._with_rng else ()
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, batch, *rng)
        return {"loss": float(loss)}

    def close(self) -> None:
        """Nothing to let go: the state is JAX arrays, freed with the trainer."""
