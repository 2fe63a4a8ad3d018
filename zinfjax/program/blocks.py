"""A block of one axis of an initialiser's output, computed without the whole array: one tile of a layer.

`zinfjax.program.rows` computes row chunks of an embedding table; a tile of a layer
(`zinfjax.models.tiling`) is a block of another axis: the columns ``lo .. lo + n`` of an MLP's input
kernel, a group of heads of a query kernel. The same reasoning holds: with JAX's partitionable
threefry, random bit ``k`` of ``random_bits(key, shape)`` depends on its flat index alone, and an
initialiser is elementwise code over such bits (``normal(key, (d, f)) * std``, then a reshape).
`block` runs that code over the block's elements only, so a 1 GB layer kernel is initialised a tile
at a time, and the values equal, bit for bit, the block of the whole (tests/program/test_init.py).
Anything else on the way (a reduction, a transpose) raises `rows.Unsliceable`; the caller computes the
leaf whole.

Example:
    >>> import jax
    >>> init = lambda k: jax.random.normal(k, (96, 384)) * 0.02          # an MLP's input kernel, (D, 4 D)
    >>> key = jax.random.key(0)
    >>> closed, _ = jx.trace(init, key)
    >>> jaxpr = closed.jaxpr
    >>> w = block(jaxpr.eqns, {jaxpr.invars[0]: key}, jaxpr.outvars[0], axis=1, lo=128, n=128)   # columns 128..255
    >>> w.shape, bool((w == init(key)[:, 128:256]).all())
    ((96, 128), True)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from zinfjax.program import jaxpr as jx
from zinfjax.program.rows import Unsliceable, _Walker


def block(eqns, env: dict, outvar, axis: int, lo, n: int):
    """Elements ``lo .. lo + n`` along ``axis`` of ``outvar``, from ``eqns`` evaluated on ``env`` (its inputs).

    ``lo`` may be traced (one compile serves every tile); ``n`` is static.
    """
    producer = {v: e for e in eqns for v in e.outvars if jx.is_var(v)}
    target, a, lo_t, n_t, shape_out = outvar, axis, lo, n, tuple(outvar.aval.shape)
    while target in producer and producer[target].primitive.name == "reshape":  # a reshape at the end: map back
        mapped = _through_reshape(producer[target], a, lo_t, n_t)
        if mapped is None:
            break
        target, a, lo_t, n_t = mapped
    walker = _Block(tuple(target.aval.shape), a, lo_t, n_t)
    value = walker.run(jx.dce(eqns, [target]), dict(env))[target]
    if target not in walker.sliced:
        raise Unsliceable("the tile does not come from elementwise code")
    out_shape = list(shape_out)
    out_shape[axis] = n
    return value.reshape(out_shape)


def _through_reshape(eqn, axis: int, lo, n: int):
    """The block of the reshape's input that holds the block of its output: ``(var, axis, lo, n)`` or None."""
    x = eqn.invars[0]
    if not jx.is_var(x) or eqn.params.get("dimensions"):
        return None
    out, shape = tuple(eqn.outvars[0].aval.shape), tuple(x.aval.shape)
    lead, inner = math.prod(out[:axis]), math.prod(out[axis + 1:])
    for b in range(len(shape)):
        if math.prod(shape[:b]) == lead and inner % math.prod(shape[b + 1:]) == 0:
            scale = inner // math.prod(shape[b + 1:])
            if shape[b] == out[axis] * scale:
                return x, b, lo * scale, n * scale
    return None


class _Block(_Walker):
    """`rows`' evaluator with the block along ``axis`` in place of the leading rows: the variables of the target's
    full shape are held as blocks of ``n`` along ``axis`` from ``lo``."""

    def __init__(self, shape: tuple, axis: int, lo, n: int):
        super().__init__(shape[axis], lo, n)
        self.shape, self.axis = shape, axis

    def full(self, var) -> bool:
        return tuple(getattr(var.aval, "shape", ())) == self.shape

    def _shape(self, shape) -> tuple:
        out = list(shape)
        out[self.axis] = self.n
        return tuple(out)

    def _chunk(self, atom, x):
        if not jx.is_var(atom) or atom in self.sliced or not self.full(atom):
            return x
        return lax.dynamic_slice_in_dim(x, self.lo, self.n, self.axis)

    def _flat_index(self, shape):
        """The flat (row-major) index in the whole array of each element of the block, as uint32."""
        if math.prod(self.shape) >= 2**32:  # the counter's high word would not be 0
            raise Unsliceable("the layer has 2**32 elements or more")
        block, flat, stride = self._shape(self.shape), jnp.zeros(self._shape(self.shape), jnp.uint32), 1
        for d in reversed(range(len(self.shape))):
            index = lax.broadcasted_iota(jnp.uint32, block, d)
            if d == self.axis:
                index = index + jnp.asarray(self.lo, jnp.uint32)
            flat = flat + index * jnp.uint32(stride)
            stride *= self.shape[d]
        return flat

    def _iota(self, params: dict):
        dim = params["dimension"]
        out = lax.broadcasted_iota(params["dtype"], self._shape(params["shape"]), dim)
        return out + jnp.asarray(self.lo, params["dtype"]) if dim == self.axis else out

    def _broadcast(self, eqn, x):
        dims = eqn.params["broadcast_dimensions"]
        if self.axis in dims and jnp.shape(x)[dims.index(self.axis)] != 1:
            raise Unsliceable("broadcast_in_dim spans the tile's axis")
        return lax.broadcast_in_dim(x, self._shape(eqn.params["shape"]), dims)
