"""Tiles in Flax NNX: `TiledDense` and `TiledMLP`, tiles made by ``nnx.vmap`` and run by ``nnx.scan``.

The same math, parameter shapes and initialisation as the Linen modules of ``zinfjax.models.tiled``
(whose docstring explains the tiles): the stacked tile parameters are made with ``nnx.split_rngs`` and
``nnx.vmap``, one key per tile, and applied with one ``nnx.scan`` whose input is broadcast and whose
carry is the accumulator. Parameters: ``tiles.kernel`` and ``bias`` (`TiledDense`); ``tiles.w_in``,
``tiles.b_in``, ``tiles.w_out`` and ``b_out`` (`TiledMLP`).

Example:
    >>> layer = TiledDense(16, 8, in_splits=2, out_splits=4, rngs=nnx.Rngs(0))
    >>> layer.tiles.kernel.shape, layer(jnp.ones((3, 16))).shape
    ((8, 8, 2), (3, 8))
    >>> mlp = TiledMLP(16, 32, tiles=4, rngs=nnx.Rngs(0))
    >>> mlp.tiles.w_in.shape, mlp.tiles.b_in.shape, mlp.tiles.w_out.shape, mlp(jnp.ones((3, 16))).shape
    ((4, 16, 8), (4, 8), (4, 8, 16), (3, 16))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zinfjax.models.tiled import (
    UNROLL,
    Initializer,
    add_bias,
    check_splits,
    compute_dtype,
    default_bias_init,
    default_kernel_init,
    dense_tile,
    mlp_tile,
    whole_layer_init,
)

Dtype = Any


def _stacked(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """``count`` modules ``make(rngs)`` stacked on a leading axis, each drawn from its own split of ``rngs``."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return build(rngs)


def _bias(use_bias: bool, init: Initializer, size: int, dtype: Dtype, rngs: nnx.Rngs) -> nnx.Param | None:
    """A ``(size,)`` bias parameter, or None without ``use_bias``."""
    return nnx.Param(init(rngs.params(), (size,), dtype)) if use_bias else None


class _DenseTile(nnx.Module):
    """One tile of `TiledDense`: its kernel ``(in_t, out_t)``."""

    def __init__(self, shape: tuple[int, int], init: Initializer, dtype: Dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(init(rngs.params(), shape, dtype))


class TiledDense(nnx.Module):
    """``nnx.Linear(in_features, out_features)`` with its kernel in ``in_splits x out_splits`` tiles, one ``nnx.scan``.

    Params: ``tiles.kernel`` ``(in_splits * out_splits, in/in_splits, out/out_splits)`` and ``bias`` ``(out,)``;
    the math of ``zinfjax.models.tiled.TiledDense``.
    """

    def __init__(self, in_features: int, out_features: int, *, in_splits: int = 1, out_splits: int = 1,
                 use_bias: bool = True, dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 kernel_init: Initializer = default_kernel_init, bias_init: Initializer = default_bias_init,
                 dot_general: Callable | None = None, rngs: nnx.Rngs):
        shape = (check_splits(in_features, in_splits, "in_splits"),
                 check_splits(out_features, out_splits, "out_splits"))
        self.in_features, self.out_features, self.out_splits = in_features, out_features, out_splits
        self.count, self.dtype, self.param_dtype = in_splits * out_splits, dtype, param_dtype
        self.dot_general = dot_general
        init = whole_layer_init(kernel_init, (in_features, out_features))
        self.tiles = _stacked(lambda r: _DenseTile(shape, init, param_dtype, r), self.count, rngs)
        self.bias = _bias(use_bias, bias_init, out_features, param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = compute_dtype(x, self.param_dtype, self.dtype)
        out_splits, dot_general = self.out_splits, self.dot_general

        @nnx.scan(in_axes=(0, nnx.Carry, 0, None), out_axes=nnx.Carry, unroll=UNROLL)
        def run(tile: _DenseTile, acc: jax.Array, t: jax.Array, x: jax.Array) -> jax.Array:
            return dense_tile(acc, x, tile.kernel[...], t, out_splits, dot_general)

        acc = run(self.tiles, jnp.zeros((*x.shape[:-1], self.out_features), dtype), jnp.arange(self.count),
                  x.astype(dtype))
        return add_bias(acc, None if self.bias is None else self.bias[...])


class _MLPTile(nnx.Module):
    """One tile of `TiledMLP`'s hidden units: ``w_in (d, width)``, ``b_in (width,)`` and ``w_out (width, d)``."""

    def __init__(self, d_model: int, width: int, inits: tuple[Initializer, Initializer, Initializer],
                 use_bias: bool, dtype: Dtype, rngs: nnx.Rngs):
        in_init, out_init, bias_init = inits
        self.w_in = nnx.Param(in_init(rngs.params(), (d_model, width), dtype))
        self.b_in = _bias(use_bias, bias_init, width, dtype, rngs)
        self.w_out = nnx.Param(out_init(rngs.params(), (width, d_model), dtype))


class TiledMLP(nnx.Module):
    """``act(x @ W_in + b_in) @ W_out + b_out`` with the hidden dimension ``d_ff`` in ``tiles``, one ``nnx.scan``.

    Params: ``tiles.w_in`` ``(tiles, d_model, d_ff/tiles)``, ``tiles.b_in`` ``(tiles, d_ff/tiles)``,
    ``tiles.w_out`` ``(tiles, d_ff/tiles, d_model)`` and ``b_out`` ``(d_model,)``; the math of
    ``zinfjax.models.tiled.TiledMLP``.
    """

    def __init__(self, d_model: int, d_ff: int, tiles: int, *, activation: Callable = nnx.gelu, use_bias: bool = True,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32, dot_general: Callable | None = None,
                 kernel_init: Initializer = default_kernel_init, bias_init: Initializer = default_bias_init,
                 rngs: nnx.Rngs):
        width = check_splits(d_ff, tiles, "tiles")
        self.d_model, self.activation, self.dtype, self.param_dtype = d_model, activation, dtype, param_dtype
        self.dot_general = dot_general
        inits = (whole_layer_init(kernel_init, (d_model, d_ff)), whole_layer_init(kernel_init, (d_ff, d_model)),
                 bias_init)
        self.tiles = _stacked(lambda r: _MLPTile(d_model, width, inits, use_bias, param_dtype, r), tiles, rngs)
        self.b_out = _bias(use_bias, bias_init, d_model, param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = compute_dtype(x, self.param_dtype, self.dtype)
        activation, dot_general = self.activation, self.dot_general

        @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry, unroll=UNROLL)
        def run(tile: _MLPTile, acc: jax.Array, x: jax.Array) -> jax.Array:
            b_in = None if tile.b_in is None else tile.b_in[...]
            return mlp_tile(acc, x, tile.w_in[...], b_in, tile.w_out[...], activation, dot_general)

        acc = run(self.tiles, jnp.zeros((*x.shape[:-1], self.d_model), dtype), x.astype(dtype))
        return add_bias(acc, None if self.b_out is None else self.b_out[...])
