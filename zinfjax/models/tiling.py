"""The reference models' MLP and attention run tile by tile: a scan over views of each layer's weights.

With ``ModelConfig.tiles = T`` a block's MLP is cut along its hidden dimension into ``T`` tiles and
its attention into ``T`` groups of heads, and each runs as a ``lax.scan`` over the tiles:

    mlp(x)  = sum_t act(x W_in[:, t] + b_in[t]) W_out[t, :] + b_out      (t = 0 .. T-1, in that order)
    attn(x) = sum_t attention(x W_q[:, t], x W_k[:, t], x W_v[:, t]) W_o[t] + b_o

The weights are the untiled layer's own, declared as `DenseWeights` under the same names with the
same initialisers (so ``model.init`` gives the same tree, bit for bit, for every ``T``), and each
scan reads a *view* of them: ``moveaxis(W.reshape(..., T, n // T, ...), axis, 0)``. That is what
lets zinfjax stream one tile of one layer at a time (`zinfjax.program.nested`): only the tile a scan
iteration reads is ever read, while checkpoints, conversion and generation see the usual leaves.
The sums run in fp32, tile after tile: tiling reorders the MLP's and attention's sums, nothing else.

Example:
    >>> w = jnp.arange(12.0).reshape(3, 4)                    # a (d_in, d_ff) kernel, d_ff cut in 2 tiles
    >>> tile_view(w, axis=1, tiles=2).shape                   # what the scan over tiles reads
    (2, 3, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.models import products
from zinfjax.models.products import accumulator
from zinfjax.models.tiled import UNROLL


class DenseWeights(nn.Module):
    """The kernel (and bias) ``nn.DenseGeneral`` declares for inputs ``in_shape`` and ``features``, initialised
    as it initialises them (its flat-shape initialiser, reshaped): the same values under the same name."""

    in_shape: tuple[int, ...]
    features: tuple[int, ...]
    kernel_init: Callable
    use_bias: bool = True
    bias_init: Callable = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self):
        n_in, n_out = int(np.prod(self.in_shape)), int(np.prod(self.features))
        kernel = self.param("kernel", lambda rng, shape: self.kernel_init(rng, (n_in, n_out)).reshape(shape),
                            (*self.in_shape, *self.features))
        bias = self.param("bias", lambda rng, shape: self.bias_init(rng, (n_out,)).reshape(shape),
                          self.features) if self.use_bias else None
        return kernel, bias


def tile_view(w: jax.Array, axis: int, tiles: int) -> jax.Array:
    """``w`` cut along ``axis`` into ``tiles`` blocks, stacked in front: the tiles a scan reads.

    Example:
        >>> tile_view(jnp.arange(8.0).reshape(2, 4), axis=1, tiles=2)[1]
        Array([[2., 3.],
               [6., 7.]], dtype=float32)
    """
    shape = w.shape
    split = (*shape[:axis], tiles, shape[axis] // tiles, *shape[axis + 1:])
    return jnp.moveaxis(w.reshape(split), axis, 0)


def contract(x: jax.Array, w: jax.Array, n: int, dtype) -> jax.Array:
    """``x``'s last ``n`` axes contracted with ``w``'s first ``n``, in ``dtype`` (``nn.DenseGeneral``'s product)."""
    x, w = x.astype(dtype), w.astype(dtype)
    dims = ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
    return products.dot_general(x, w, dims)


def add_bias(y: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """``y + b`` with ``b`` over ``y``'s trailing axes, in ``dtype`` (as ``nn.DenseGeneral`` adds its bias)."""
    return y + b.astype(dtype).reshape((1,) * (y.ndim - b.ndim) + b.shape)


def tiled_sum(fn: Callable, x: jax.Array, tiles: tuple, dtype: Any) -> jax.Array:
    """``sum_t fn(x, tile_t)`` over the stacked ``tiles``, in fp32 and in order, as a ``lax.scan`` (``x`` a const)."""

    def body(acc, tile):
        return acc + fn(x, *tile).astype(wide), None

    wide = accumulator(dtype)
    acc, _ = jax.lax.scan(body, jnp.zeros((*x.shape[:-1], _out_width(fn, x, tiles)), wide), tiles,
                          unroll=UNROLL)
    return acc.astype(dtype)


def _out_width(fn, x, tiles) -> int:
    first = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], t.dtype), tiles)
    return jax.eval_shape(lambda x, t: fn(x, *t), x, first).shape[-1]
