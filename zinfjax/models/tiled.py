"""Tiles: a dense layer or an MLP larger than memory, as one ``nn.scan`` over its tiles (DeepSpeed's ``TiledLinear``).

`TiledDense` cuts its ``(in, out)`` kernel into ``in_splits x out_splits`` tiles of shape
``(in/in_splits, out/out_splits)``, stacked on a leading axis in the params (tile ``t`` is block
``(i, j) = divmod(t, out_splits)``, i-major), and runs them as one ``nn.scan``: the input is a
broadcast constant of the scan, the carry is the output ``(..., out)``, and tile ``(i, j)`` adds
``x[..., block i] @ W_ij`` to the output's block ``j``, tiles in ascending order. `TiledMLP` cuts
the MLP's hidden dimension into ``tiles``: tile ``t`` adds ``act(x @ W_in_t + b_in_t) @ W_out_t``.
Biases of the outputs are untiled parameters added after the scan. zinfjax streams a scan over
parameters like a scan over layers, so such a layer's parameters need not be in memory whole
(docs/models.md, "Tiles: a layer larger than memory").

A tile is initialised as a view of the whole layer (`whole_layer_init`): its values have the
distribution that ``kernel_init`` gives the whole kernel. `tile_kernel` and `untile_kernel` move
weights between a Dense kernel ``(..., in, out)`` and the stacked tiles ``(..., T, in_t, out_t)``,
bit for bit; the NNX modules with the same math are in ``zinfjax.models.tiled_nnx``.

Example:
    >>> x = jnp.ones((3, 16))
    >>> layer = TiledDense(8, in_splits=2, out_splits=4)
    >>> params = layer.init(jax.random.key(0), x)["params"]
    >>> params["tiles"]["kernel"].shape, params["bias"].shape
    ((8, 8, 2), (8,))
    >>> kernel = untile_kernel(params["tiles"]["kernel"], 2, 4)
    >>> dense = nn.Dense(8).apply({"params": {"kernel": kernel, "bias": params["bias"]}}, x)
    >>> bool(jnp.allclose(layer.apply({"params": params}, x), dense, rtol=1e-6))
    True
    >>> mlp = TiledMLP(d_ff=32, tiles=4)
    >>> jax.tree.map(jnp.shape, mlp.init(jax.random.key(0), x)["params"]["tiles"])
    {'b_in': (4, 8), 'w_in': (4, 16, 8), 'w_out': (4, 8, 16)}
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zinfjax.errors import ConfigError

Dtype = Any
Initializer = Callable[..., jax.Array]
default_kernel_init = nn.initializers.lecun_normal()
default_bias_init = nn.initializers.zeros_init()
_SPREADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # `spread_model`'s, per initializer
_SPREADS[default_kernel_init] = np.array([0.0, 1.0, 0.0, 0.0])  # lecun_normal: 1 / variance = fan_in

# `fan_scale` probes an initializer on these small shapes: the spread of its values as a function of the fans.
# Where XLA compiles the scan over tiles whole (a layer the engine streams whole, or the plain in-memory loop),
# it is unrolled: a rolled loop slices each tile's weights out and stacks their gradients back, which made a tiled
# gpt2-small layer's backward 1.2x the untiled one on the CPU, unrolled 0.9x (docs/BENCHMARKS.md, "Tiles where they
# are not needed"). The engine's tile-by-tile streaming cuts the scan into its iterations either way.
UNROLL = True
PROBE_SHAPES = ((2, 2), (2, 4), (4, 2), (4, 4))  # few: the first use of each shape compiles JAX's random ops
PROBE_VALUES = 4  # the values compared: the first 4 of each probe, drawn from the same random bits
# The terms of 1 / variance tried (columns of `_fan_basis`): shape-free, then variance_scaling's modes fan_in,
# fan_out, fan_geo_avg and fan_avg. On the probes each has 2 or 3 degrees of freedom left to refute it.
MODELS = ((0,), (1,), (2,), (3,), (1, 2))
FIT_TOLERANCE = 1e-4  # relative: fp32 rounding of the probes is 1e-7; a scale that is not of the model misses by O(1)


def divisors(n: int) -> list[int]:
    """The counts that cut ``n`` into equal whole parts, fewest first.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def check_splits(size: int, splits: int, what: str) -> int:
    """The size of one tile of a dimension of ``size`` cut in ``splits``; a `ConfigError` that names the divisors
    of ``size`` when ``splits`` does not divide it.

    Example:
        >>> check_splits(12, 3, "in_splits")
        4
        >>> check_splits(12, 5, "in_splits")
        Traceback (most recent call last):
        zinfjax.errors.ConfigError: in_splits=5 does not divide 12: use one of its divisors 1, 2, 3, 4, 6, 12
    """
    if isinstance(splits, int) and not isinstance(splits, bool) and splits >= 1 and size % splits == 0:
        return size // splits
    raise ConfigError(f"{what}={splits!r} does not divide {size}: use one of its divisors "
                      f"{', '.join(map(str, divisors(size)))}")


def tile_kernel(kernel, in_splits: int, out_splits: int):
    """A Dense kernel ``(..., in, out)`` as stacked tiles ``(..., T, in/in_splits, out/out_splits)``, exactly.

    Tile ``t = i * out_splits + j`` is ``kernel[..., block i of the rows, block j of the columns]``. An MLP's
    ``W_in (d, d_ff)`` is ``tile_kernel(W_in, 1, tiles)`` and its ``W_out (d_ff, d)`` is
    ``tile_kernel(W_out, tiles, 1)``. numpy arrays stay numpy arrays.

    Example:
        >>> tile_kernel(np.arange(8).reshape(2, 4), 2, 2).tolist()
        [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    """
    if kernel.ndim < 2:
        raise ConfigError(f"a kernel has an input and an output axis; this one has shape {tuple(kernel.shape)}")
    *lead, n_in, n_out = kernel.shape
    in_t, out_t = check_splits(n_in, in_splits, "in_splits"), check_splits(n_out, out_splits, "out_splits")
    blocks = kernel.reshape(*lead, in_splits, in_t, out_splits, out_t).swapaxes(-3, -2)
    return blocks.reshape(*lead, in_splits * out_splits, in_t, out_t)


def untile_kernel(tiles, in_splits: int, out_splits: int):
    """Stacked tiles ``(..., T, in_t, out_t)`` as the Dense kernel ``(..., in, out)`` they cut, exactly: the
    inverse of `tile_kernel`.

    Example:
        >>> untile_kernel(np.arange(8).reshape(4, 1, 2), 2, 2).tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    counts = all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in (in_splits, out_splits))
    if tiles.ndim < 3 or not counts or tiles.shape[-3] != in_splits * out_splits:
        raise ConfigError(f"tiles of shape {tuple(tiles.shape)} are not {in_splits!r} x {out_splits!r} tiles "
                          f"stacked on the third axis from the end")
    *lead, _, in_t, out_t = tiles.shape
    blocks = tiles.reshape(*lead, in_splits, out_splits, in_t, out_t).swapaxes(-3, -2)
    return blocks.reshape(*lead, in_splits * in_t, out_splits * out_t)


def _fan_basis(shape: tuple[int, int]) -> np.ndarray:
    """The terms ``1 / variance`` may be made of, for a 2-D shape (fans in, out): every variance-scaling mode."""
    fan_in, fan_out = shape
    return np.array([1.0, fan_in, fan_out, math.sqrt(fan_in * fan_out)])


def _probe_powers(init: Initializer) -> np.ndarray:
    """The sum of squares of the first values ``init`` draws from one key, on each of `PROBE_SHAPES`."""
    with jax.ensure_compile_time_eval():
        key = jax.random.key(0)
        values = [np.asarray(init(key, shape, jnp.float32), np.float64).ravel() for shape in PROBE_SHAPES]
    return np.array([np.sum(np.square(v[:PROBE_VALUES])) for v in values])


def _fit(powers: np.ndarray) -> np.ndarray | None:
    """The coefficients of ``1 / variance`` on `_fan_basis` of the first of `MODELS` that fits the probes' powers,
    or None when none does. One or two terms, so the variance at large fans is not an extrapolation of
    coefficients that fp32 noise made nonzero."""
    if not powers.all():
        return None
    basis = np.stack([_fan_basis(shape) for shape in PROBE_SHAPES])
    for columns in MODELS:
        coefs = np.zeros(basis.shape[1])
        coefs[list(columns)] = np.linalg.lstsq(basis[:, columns], 1.0 / powers, rcond=None)[0]
        if np.max(np.abs(basis @ coefs * powers - 1.0)) <= FIT_TOLERANCE:
            return coefs
    return None


def spread_model(init: Initializer) -> np.ndarray | None:
    """The coefficients of ``1 / variance`` on `_fan_basis` for ``init``, or None when it fits none of `MODELS`.

    Probed once per initializer object (the probes' first run compiles JAX's random ops for each shape: seconds
    on a slow machine); the default, ``lecun_normal`` (``fan_in``), is known without probing.
    """
    try:
        return _SPREADS[init]
    except (KeyError, TypeError):  # not probed yet, or an initializer that cannot be a weak key
        pass
    powers = _probe_powers(init)
    coefs = _fit(powers) if powers.any() else np.array([1.0, 0.0, 0.0, 0.0])  # zeros: the spread ignores the shape
    try:
        _SPREADS[init] = coefs
    except TypeError:
        pass
    return coefs


def fan_scale(init: Initializer, whole: tuple[int, int], tile: tuple[int, int]) -> float:
    """The factor that gives ``init(key, tile)``'s values the spread of ``init(key, whole)``'s.

    JAX draws a value from the same random bits whatever the shape (its ``i``-th value in row-major order is the
    same for one key, with the default threefry random bits, ``jax_threefry_partitionable``), so on small probe
    shapes the ratios of the values are the ratios of the initializer's scales. ``1 / variance`` is fitted as a
    constant (an initializer whose spread ignores the shape: ``normal``, ``uniform``, constants) or as one of
    ``variance_scaling``'s modes (lecun, he, glorot: ``fan_in``, ``fan_out``, ``fan_avg``, ``fan_geo_avg``, any
    scale and distribution), and the fit gives the variance at the whole layer's and the tile's fans.

    An initializer that fits none (``orthogonal``, whose values depend on the whole matrix) is a `ConfigError`,
    as is any but the default (``lecun_normal``) under random bits that depend on the shape (another
    ``jax_default_prng_impl``, or ``jax_threefry_partitionable=False``).

    Example:
        >>> fan_scale(nn.initializers.lecun_normal(), (64, 8), (16, 8))  # fan_in 64 against 16
        0.5
        >>> fan_scale(nn.initializers.normal(0.02), (64, 8), (16, 8))
        1.0
    """
    whole, tile = tuple(whole), tuple(tile)
    if whole == tile:
        return 1.0
    coefs = spread_model(init)
    inverse_whole, inverse_tile = (0.0, 0.0) if coefs is None else (float(_fan_basis(s) @ coefs) for s in (whole, tile))
    if not (inverse_whole > 0 and inverse_tile > 0):
        raise ConfigError(f"the initializer {getattr(init, '__qualname__', init)} draws values whose spread is "
                          f"neither fixed nor variance scaling's, so a {tile} tile cannot have the {whole} layer's "
                          f"distribution: use a variance-scaling or shape-free initializer, or tile_kernel a Dense "
                          f"layer's kernel")
    return float(f"{math.sqrt(inverse_tile / inverse_whole):.6g}")  # the fit's precision: 1/2 stays 1/2


def whole_layer_init(init: Initializer, whole: tuple[int, int]) -> Initializer:
    """``init`` for a tile of a ``whole``-shaped kernel: the tile's values have the distribution the whole
    kernel's values would have (`fan_scale`), drawn in fp32 (or wider) and rescaled before the cast to ``dtype``.

    Example:
        >>> tile = whole_layer_init(nn.initializers.lecun_normal(), (4096, 64))(jax.random.key(0), (1024, 64))
        >>> round(float(jnp.std(tile)) * 4096 ** 0.5, 1)
        1.0
    """

    def tile_init(key: jax.Array, shape: tuple[int, ...], dtype: Dtype = jnp.float32) -> jax.Array:
        factor = fan_scale(init, tuple(whole), tuple(shape))
        if factor == 1.0:
            return init(key, shape, dtype)
        wide = jnp.promote_types(dtype, jnp.float32)
        return (init(key, shape, wide) * jnp.asarray(factor, wide)).astype(dtype)

    return tile_init


def compute_dtype(x: jax.Array, param_dtype: Dtype, dtype: Dtype | None) -> Dtype:
    """The dtype of the tiles' products and of the accumulator: ``dtype``, or that of ``x`` and the params together."""
    return nn.dtypes.canonicalize_dtype(x, jnp.zeros((), param_dtype), dtype=dtype)


def _product(a: jax.Array, w: jax.Array, dot_general: Callable | None) -> jax.Array:
    """``a @ w`` over the last axis of ``a`` and the first of ``w``, by ``dot_general`` (``lax.dot_general``)."""
    return (dot_general or lax.dot_general)(a, w, (((a.ndim - 1,), (0,)), ((), ())))


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``y + bias`` over the last axis (explicitly broadcast, as ``nn.Dense`` adds it)."""
    return y if bias is None else y + bias.astype(y.dtype).reshape((1,) * (y.ndim - 1) + (-1,))


def dense_tile(acc: jax.Array, x: jax.Array, kernel: jax.Array, t: jax.Array, out_splits: int,
               dot_general: Callable | None = None) -> jax.Array:
    """One step of `TiledDense`: tile ``t = (i, j)`` adds ``x[..., block i] @ kernel`` to ``acc[..., block j]``."""
    in_t, out_t = kernel.shape
    splits = jnp.asarray(out_splits, t.dtype)
    i, j = lax.div(t, splits), lax.rem(t, splits)  # t >= 0
    x_i = lax.dynamic_slice_in_dim(x, i * in_t, in_t, x.ndim - 1)
    part = _product(x_i, kernel.astype(acc.dtype), dot_general)
    block = lax.dynamic_slice_in_dim(acc, j * out_t, out_t, acc.ndim - 1)
    return lax.dynamic_update_slice_in_dim(acc, block + part, j * out_t, acc.ndim - 1)


def mlp_tile(acc: jax.Array, x: jax.Array, w_in: jax.Array, b_in: jax.Array | None, w_out: jax.Array,
             activation: Callable, dot_general: Callable | None = None) -> jax.Array:
    """One step of `TiledMLP`: ``acc + activation(x @ w_in + b_in) @ w_out`` for one tile of the hidden units."""
    h = activation(add_bias(_product(x, w_in.astype(acc.dtype), dot_general), b_in))
    return acc + _product(h, w_out.astype(acc.dtype), dot_general)


class _DenseTiles(nn.Module):
    """The body `TiledDense` scans: one tile's kernel ``(in_t, out_t)``, named ``kernel``, and its product."""

    shape: tuple[int, int]
    out_splits: int
    kernel_init: Initializer
    param_dtype: Dtype
    dot_general: Callable | None

    @nn.compact
    def __call__(self, acc: jax.Array, t: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        kernel = self.param("kernel", self.kernel_init, self.shape, self.param_dtype)
        return dense_tile(acc, x, kernel, t, self.out_splits, self.dot_general), None


class TiledDense(nn.Module):
    """``nn.Dense(features)`` with its kernel in ``in_splits x out_splits`` tiles, run as one ``nn.scan``.

    Params: ``tiles/kernel`` ``(in_splits * out_splits, in/in_splits, features/out_splits)`` (`tile_kernel`'s
    layout of the Dense kernel) and, with ``use_bias``, ``bias`` ``(features,)``, added after the scan. The
    accumulator is in the computation dtype (``dtype``, or promoted from the input's and ``param_dtype``), so
    with a low-precision dtype and ``in_splits > 1`` the partial sums round to it between tiles, as
    DeepSpeed's ``TiledLinear`` does. ``dot_general`` takes each tile's product (``zinfjax.models.products``).
    """

    features: int
    in_splits: int = 1
    out_splits: int = 1
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init
    dot_general: Callable | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n_in, count = x.shape[-1], self.in_splits * self.out_splits
        shape = (check_splits(n_in, self.in_splits, "in_splits"),
                 check_splits(self.features, self.out_splits, "out_splits"))
        dtype = compute_dtype(x, self.param_dtype, self.dtype)
        scan = nn.scan(_DenseTiles, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(0, nn.broadcast), length=count, unroll=UNROLL)
        tiles = scan(shape, self.out_splits, whole_layer_init(self.kernel_init, (n_in, self.features)),
                     self.param_dtype, self.dot_general, name="tiles")
        acc = jnp.zeros((*x.shape[:-1], self.features), dtype)
        acc, _ = tiles(acc, jnp.arange(count), x.astype(dtype))
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        return add_bias(acc, bias)


class _MLPTiles(nn.Module):
    """The body `TiledMLP` scans: one tile of the hidden units, params ``w_in``, ``b_in`` and ``w_out``."""

    d_model: int
    width: int
    activation: Callable
    use_bias: bool
    param_dtype: Dtype
    inits: tuple[Initializer, Initializer, Initializer]  # w_in, w_out, b_in
    dot_general: Callable | None

    @nn.compact
    def __call__(self, acc: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        in_init, out_init, bias_init = self.inits
        w_in = self.param("w_in", in_init, (self.d_model, self.width), self.param_dtype)
        b_in = self.param("b_in", bias_init, (self.width,), self.param_dtype) if self.use_bias else None
        w_out = self.param("w_out", out_init, (self.width, self.d_model), self.param_dtype)
        return mlp_tile(acc, x, w_in, b_in, w_out, self.activation, self.dot_general), None


class TiledMLP(nn.Module):
    """``act(x @ W_in + b_in) @ W_out + b_out`` with the hidden dimension ``d_ff`` in ``tiles``, run as one ``nn.scan``.

    Params: ``tiles/w_in`` ``(tiles, d, d_ff/tiles)``, ``tiles/b_in`` ``(tiles, d_ff/tiles)`` (with ``use_bias``),
    ``tiles/w_out`` ``(tiles, d_ff/tiles, d)`` and ``b_out`` ``(d,)`` (with ``use_bias``), ``d`` the input's
    width. ``W_in`` is ``untile_kernel(w_in, 1, tiles)``, ``W_out`` ``untile_kernel(w_out, tiles, 1)``, ``b_in``
    ``b_in.reshape(d_ff)``. The tiles add into an accumulator ``(..., d)`` in the computation dtype, in
    ascending order; each is initialised as a view of the whole ``(d, d_ff)`` and ``(d_ff, d)`` kernels.
    """

    d_ff: int
    tiles: int
    activation: Callable = nn.gelu
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    dot_general: Callable | None = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = default_bias_init

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        width = check_splits(self.d_ff, self.tiles, "tiles")
        dtype = compute_dtype(x, self.param_dtype, self.dtype)
        inits = (whole_layer_init(self.kernel_init, (d, self.d_ff)),
                 whole_layer_init(self.kernel_init, (self.d_ff, d)), self.bias_init)
        scan = nn.scan(_MLPTiles, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=nn.broadcast, length=self.tiles, unroll=UNROLL)
        tiles = scan(d, width, self.activation, self.use_bias, self.param_dtype, inits, self.dot_general,
                     name="tiles")
        acc, _ = tiles(jnp.zeros((*x.shape[:-1], d), dtype), x.astype(dtype))
        bias = self.param("b_out", self.bias_init, (d,), self.param_dtype) if self.use_bias else None
        return add_bias(acc, bias)
