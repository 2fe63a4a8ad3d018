"""Checks that a test's float64 twin of an fp32 loop really runs in float64 (tests/support/tolerances.py).

A twin run under ``jax.enable_x64`` from ``in_float64`` parameters is the exact computation an fp32 result is
judged against; a module that casts to fp32 on its own (a ``dtype=jnp.float32`` left in place) would make it
an fp32 run, and the "truth" as far from the exact one as the runs it judges. So a twin's leaves, and every
matrix product of its loss, are checked to be float64.

>>> import jax.numpy as jnp
>>> with jax.enable_x64(True):
...     assert_products_in_float64(lambda w: jnp.sum(w @ w), jnp.ones((2, 2), jnp.float64))
"""

from __future__ import annotations

import re

import jax
import numpy as np


def assert_float64(tree) -> None:
    """Every floating leaf of ``tree`` is float64."""
    kinds = {np.asarray(x).dtype for x in jax.tree.leaves(tree) if np.issubdtype(np.asarray(x).dtype, np.floating)}
    assert kinds == {np.dtype(np.float64)}, f"a float64 twin holds {sorted(map(str, kinds))} leaves"


def assert_products_in_float64(fn, *args) -> None:
    """Every ``dot_general`` in ``fn``'s jaxpr (its sub-computations included) gives float64: call under
    ``jax.enable_x64(True)`` with float64 arguments."""
    text = str(jax.make_jaxpr(fn)(*args))
    kinds = set(re.findall(r"\b(\w+)\[[^\]]*\] = dot_general\b", text))
    assert kinds == {"f64"}, f"the float64 twin's products are {sorted(kinds)}"


def nnx_in_float64(model):
    """A twin of the NNX ``model``: float64 parameters, and float64 compute wherever a module fixes its dtype (NNX's
    ``Embed`` computes in its ``param_dtype`` unless told). Call under ``jax.enable_x64(True)``."""
    from flax import nnx

    from tests.support.tolerances import in_float64

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    twin = nnx.merge(graphdef, in_float64(params), rest)
    for _, module in nnx.iter_modules(twin):
        if getattr(module, "dtype", None) is not None:
            module.dtype = np.float64
    return twin
