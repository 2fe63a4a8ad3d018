"""A row chunk of an initialiser's output, computed without the whole array.

An embedding table is initialised by elementwise code over random bits: ``normal(key, (V, D)) *
std``. Rows ``lo .. lo + n`` of it need only the bits of those rows, and with JAX's partitionable
threefry (the default) bit ``k`` of ``random_bits(key, shape)`` is ``threefry(key, k)``: a function
of its flat index alone. `row_chunk` runs the initialiser's jaxpr over row chunks: random bits
and iotas of the chunk's indices, elementwise operations on chunks, broadcasts to the chunk's
shape. The values equal, bitwise, rows ``lo .. lo + n`` of the whole (tests/program/test_init.py), and the
whole table never exists. Anything else on the way to the table (a reshape, a matmul) raises
`Unsliceable`, and the caller computes the table whole.

Example:
    >>> init = lambda k: jax.random.normal(k, (1000, 8)) * 0.02
    >>> key = jax.random.key(0)
    >>> closed, _ = jx.trace(init, key)
    >>> chunk = row_chunk(closed, closed.jaxpr.outvars[0], key, lo=200, n=100)   # rows 200..299
    >>> bool((chunk == init(key)[200:300]).all())
    True
"""

from __future__ import annotations

import jax
import jax.extend.random as jrandom
import jax.numpy as jnp
from jax import lax

from zinfjax.program import jaxpr as jx

ELEMENTWISE = frozenset(
    "abs add and atan2 bitcast_convert_type cbrt ceil clamp convert_element_type copy copy_p cos cosh div eq erf "
    "erf_inv erfc exp exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg "
    "nextafter not or pow rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin "
    "sinh sqrt square stop_gradient sub tan tanh xor".split())
CALLS = (*jx.CALLS, "custom_jvp_call", "custom_vjp_call")


class Unsliceable(Exception):
    """The initialiser computes the table in a way `row_chunk` does not follow."""


def row_chunk(closed, outvar, rng, lo, n: int):
    """Rows ``lo .. lo + n`` of ``outvar`` of ``closed`` (a jaxpr of one key argument); rows past its end are 0.

    ``lo`` may be traced (one compile serves every chunk); ``n`` is static.
    """
    rows = outvar.aval.shape[0]
    walker = _Walker(rows, lo, n)
    env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True)) | {closed.jaxpr.invars[0]: rng}
    value = walker.run(jx.dce(closed.jaxpr.eqns, [outvar]), env)[outvar]
    if outvar not in walker.sliced:
        raise Unsliceable("the table does not come from row-wise code")
    valid = (lo + lax.broadcasted_iota(jnp.int32, value.shape, 0)) < rows
    return jnp.where(valid, value, jnp.zeros((), value.dtype))


class _Walker:
    """Evaluates eqns with the variables of ``rows`` leading rows held as chunks of ``n`` rows from ``lo``."""

    def __init__(self, rows: int, lo, n: int):
        self.rows, self.lo, self.n = rows, lo, n
        self.sliced: set = set()

    def full(self, var) -> bool:
        shape = getattr(var.aval, "shape", ())
        return len(shape) > 0 and shape[0] == self.rows

    def run(self, eqns, env: dict) -> dict:
        for eqn in eqns:
            outs = self.eqn(eqn, [jx.read(env, a) for a in eqn.invars])
            for var, value in zip(eqn.outvars, outs, strict=True):
                if jx.is_var(var):
                    env[var] = value
        return env

    def eqn(self, eqn, args: list) -> list:
        name = eqn.primitive.name
        touched = any(jx.is_var(a) and a in self.sliced for a in eqn.invars)
        if not touched and not any(self.full(v) for v in eqn.outvars):
            return self._plain(eqn, args)
        if name in CALLS and jx.sub_jaxpr(eqn, CALLS) is not None:
            return self._call(eqn, args)
        if not all(self.full(v) for v in eqn.outvars if jx.is_var(v)):
            raise Unsliceable(f"{name} reduces the table's rows")
        if name == "random_bits":
            out = self._bits(args[0], eqn.params)
        elif name == "iota":
            out = self._iota(eqn.params)
        elif name == "broadcast_in_dim":
            out = self._broadcast(eqn, args[0])
        elif name in ELEMENTWISE:
            args = [self._chunk(a, x) for a, x in zip(eqn.invars, args, strict=True)]
            out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        else:
            raise Unsliceable(f"{name} is not row-wise")
        outs = out if eqn.primitive.multiple_results else [out]
        self.sliced.update(v for v in eqn.outvars if jx.is_var(v))
        return outs

    def _plain(self, eqn, args: list) -> list:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        return out if eqn.primitive.multiple_results else [out]

    def _call(self, eqn, args: list) -> list:
        body, consts = jx.sub_jaxpr(eqn, CALLS)
        env = dict(zip(body.constvars, consts, strict=True))
        for var, a, x in zip(body.invars, eqn.invars, args, strict=True):
            env[var] = x
            if jx.is_var(a) and a in self.sliced:
                self.sliced.add(var)
        env = self.run(body.eqns, env)
        outs = [jx.read(env, v) for v in body.outvars]
        for inner, outer in zip(body.outvars, eqn.outvars, strict=True):
            if jx.is_var(inner) and inner in self.sliced and jx.is_var(outer):
                self.sliced.add(outer)
        return outs

    def _chunk(self, atom, x):
        """An operand as a chunk: sliced already, a full-size constant cut to the chunk, or a broadcastable one."""
        if not jx.is_var(atom) or atom in self.sliced or not self.full(atom):
            return x
        padded = jnp.pad(x, [(0, self.n)] + [(0, 0)] * (x.ndim - 1))
        return lax.dynamic_slice_in_dim(padded, self.lo, self.n, 0)

    def _shape(self, shape) -> tuple:
        return (self.n, *shape[1:])

    def _flat_index(self, shape):
        """The flat (row-major) index of each element of the chunk in the whole array, as uint32."""
        stride = 1
        for d in shape[1:]:
            stride *= int(d)
        if self.rows * stride >= 2**32:  # the counter's high word would not be 0
            raise Unsliceable("the table has 2**32 elements or more")
        local = lax.iota(jnp.uint32, self.n * stride).reshape(self._shape(shape))
        return local + jnp.asarray(self.lo, jnp.uint32) * jnp.uint32(stride)

    def _bits(self, key, params: dict):
        if not jax.config.jax_threefry_partitionable or "threefry" not in str(jax.random.key_impl(key)):
            raise Unsliceable("row chunks of random bits need partitionable threefry keys")
        shape, width = params["shape"], params["bit_width"]
        data = jax.random.key_data(key)
        low = self._flat_index(shape)
        bits1, bits2 = jrandom.threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(low), low)
        if width == 32:
            return bits1 ^ bits2
        if width == 64:
            raise Unsliceable("64-bit random bits")
        return (bits1 ^ bits2).astype(jnp.dtype(f"uint{width}"))

    def _iota(self, params: dict):
        shape, dim = self._shape(params["shape"]), params["dimension"]
        out = lax.broadcasted_iota(params["dtype"], shape, dim)
        return out + jnp.asarray(self.lo, params["dtype"]) if dim == 0 else out

    def _broadcast(self, eqn, x):
        dims, atom = eqn.params["broadcast_dimensions"], eqn.invars[0]
        if 0 in dims and dims.index(0) != 0:
            raise Unsliceable("broadcast_in_dim moves the table's rows")
        if 0 in dims and jnp.shape(x)[0] != 1:
            x = self._chunk(atom, x)  # rows in: a chunk already, or a full-size constant to cut
        return lax.broadcast_in_dim(x, self._shape(eqn.params["shape"]), dims)
