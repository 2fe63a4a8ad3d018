"""The jitted per-layer functions the streaming step calls.

Each works on all micro-batches of a step at once (a leading axis ``A``), looping over
them with ``lax.map`` in the same order as the reference trainer, so that all
micro-batches pass through layer ``i`` before layer ``i+1`` is touched: parameters
are read once per step however many micro-batches there are.

Backward functions recompute their layer inside the VJP (activation checkpointing at
layer boundaries) and return gradients averaged over micro-batches, as the reference does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zinfjax.models.layered import Layers


def _mean0(tree):
    return jax.tree.map(lambda g: jnp.mean(g, axis=0), tree)


class LayerFunctions(NamedTuple):
    """Jitted functions over one layer; ``A`` micro-batches lead every activation."""

    embed_fwd: callable  # (p_embed, x[A,b,T]) -> h[A,b,T,D]
    block_fwd: callable  # (p_block, h) -> h
    head_fwd_bwd: callable  # (p_head, p_embed, h, y, scale) -> (loss, dh, g_head, g_embed)
    block_bwd: callable  # (p_block, h, dh) -> (dh_in, g_block)
    embed_bwd: callable  # (p_embed, x, dh) -> g_embed


@functools.lru_cache(maxsize=32)
def make_layer_functions(layers: Layers) -> LayerFunctions:
    """Builds the jitted per-layer functions of a layered model (cached per `Layers`, so engines share compiles).

    Example:
        >>> fns = make_layer_functions(model.layers())
        >>> h = fns.embed_fwd(p_embed, tokens[None])
    """

    def embed_fwd(p, x):
        return jax.lax.map(lambda xa: layers.embed(p, xa), x)

    def block_fwd(p, h):
        return jax.lax.map(lambda ha: layers.block(p, ha), h)

    def head_fwd_bwd(ph, pe, h, y, scale):
        def one(args):
            ha, ya = args
            loss, vjp = jax.vjp(lambda a, b, c: layers.head(a, b, c, ya), ph, pe, ha)
            g_head, g_embed, dh = vjp(scale.astype(loss.dtype))
            return loss, dh, g_head, g_embed

        losses, dh, g_head, g_embed = jax.lax.map(one, (h, y))
        return jnp.mean(losses), dh, _mean0(g_head), _mean0(g_embed)

    def block_bwd(p, h, dh):
        def one(args):
            ha, da = args
            _, vjp = jax.vjp(layers.block, p, ha)
            g, dh_in = vjp(da)
            return dh_in, g

        dh_in, g = jax.lax.map(one, (h, dh))
        return dh_in, _mean0(g)

    def embed_bwd(p, x, dh):
        def one(args):
            xa, da = args
            _, vjp = jax.vjp(lambda q: layers.embed(q, xa), p)
            return vjp(da)[0]

        return _mean0(jax.lax.map(one, (x, dh)))

    return LayerFunctions(
        embed_fwd=jax.jit(embed_fwd),
        block_fwd=jax.jit(block_fwd),
        head_fwd_bwd=jax.jit(head_fwd_bwd),
        block_bwd=jax.jit(block_bwd),
        embed_bwd=jax.jit(embed_bwd),
    )
