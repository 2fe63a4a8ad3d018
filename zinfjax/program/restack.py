"""Restacking the parameters of blocks written as a Python loop into the layout ``nn.scan`` makes.

A model whose blocks are a Python loop has parameters ``layers_0 ... layers_N``, one subtree per
block; zinfjax streams only blocks stacked on a leading layer axis. After rewriting the loop as
``nn.scan`` (or ``nnx.scan``), `stack_layers` turns parameters trained the old way into the new
layout, so nothing trained is lost.

Example:
    >>> import numpy as np
    >>> trained = {"embed": np.zeros(4), "layers_0": {"w": np.zeros((2, 2))}, "layers_1": {"w": np.ones((2, 2))}}
    >>> stacked = stack_layers(trained)
    >>> sorted(stacked), stacked["layers"]["w"].shape, stacked["layers"]["w"][1].tolist()
    (['embed', 'layers'], (2, 2, 2), [[1.0, 1.0], [1.0, 1.0]])
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from zinfjax.errors import UserError


class RestackError(UserError):
    """The blocks' parameters cannot be stacked: they differ in structure or shape."""


def stack_layers(params: dict, prefix: str = "layers_", into: str | None = None) -> dict:
    """``params`` with the subtrees ``{prefix}0 ... {prefix}N`` stacked on a new leading axis under ``into``.

    ``into`` defaults to ``prefix`` without its trailing underscore (``layers``). Every block must have
    the same tree structure and leaf shapes: that is what lets one scanned block stand for all.
    """
    pattern = re.compile(rf"{re.escape(prefix)}(\d+)$")
    found = sorted((int(m[1]), k) for k in params if (m := pattern.match(str(k))))
    if not found:
        raise RestackError(f"no subtrees named {prefix}0, {prefix}1, ... to stack")
    indices = [i for i, _ in found]
    if indices != list(range(len(found))):
        raise RestackError(f"the blocks are numbered {indices}; stack_layers needs {prefix}0 ... "
                           f"{prefix}{len(found) - 1}")
    blocks = [params[k] for _, k in found]
    first = jax.tree_util.tree_structure(blocks[0])
    shapes = [jax.tree.map(jnp.shape, b) for b in blocks]
    for (_, k), block, shape in zip(found, blocks, shapes, strict=True):
        if jax.tree_util.tree_structure(block) != first or shape != shapes[0]:
            raise RestackError(f"stack_layers needs identical blocks, but {k} differs from {found[0][1]} in structure "
                               f"or shapes ({shape} vs {shapes[0]}); only blocks of one shape can be one nn.scan")
    out = {k: v for k, v in params.items() if not pattern.match(str(k))}
    out[into or prefix.rstrip("_")] = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return out
