"""The jitted per-layer functions the streaming step calls.

Each works on all micro-batches of a step at once (a leading axis ``A``), looping over
them with ``lax.map`` in the same order as the reference trainer, so that all
micro-batches pass through layer ``i`` before layer ``i+1`` is touched: parameters
are read once per step however many micro-batches there are.

Backward functions recompute their layer inside the VJP (activation checkpointing at
layer boundaries) and return gradients averaged over micro-batches, as the reference does.

Sharding (zinfjax/sharding.py): parameters arrive as their store holds them. Each function
first constrains them to the compute layout (whole over ``data``, split over ``model``), so
under stage 3 the all-gather happens here, just in time, inside the jitted function. Gradients
leave in the stage's gradient layout: split over ``data`` from stage 2 on, so XLA
reduce-scatters them instead of all-reducing. Activations are split over ``data`` on their
batch rows and whole over ``model``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax.models.layered import Layers
from zinfjax.sharding import ShardingRules


def _mean0(tree):
    return jax.tree.map(lambda g: jnp.mean(g, axis=0), tree)


class LayerFunctions(NamedTuple):
    """Jitted functions over one layer; ``A`` micro-batches lead every activation."""

    embed_fwd: callable  # (p_embed, x[A,b,T]) -> h[A,b,T,D]
    block_fwd: callable  # (p_block, h) -> h
    head_fwd_bwd: callable  # (p_head, p_embed, h, y, scale) -> (loss, dh, g_head, g_embed)
    block_bwd: callable  # (p_block, h, dh) -> (dh_in, g_block)
    embed_bwd: callable  # (p_embed, x, dh) -> g_embed


class Layout(NamedTuple):
    """Where the layer functions put their inputs and outputs (hashable, so compiles are shared)."""

    rules: ShardingRules
    mesh: Mesh

    def gather(self, tree, group: str):
        """Parameters in the compute layout: all-gathered over ``data``, still split over ``model``."""
        return self._constrain(tree, self.rules.compute(), "params", group)

    def grads(self, tree, group: str):
        """Gradients in the stage's gradient layout."""
        return self._constrain(tree, self.rules, "grads", group)

    def rows(self, x):
        """An activation ``(A, b, ...)`` split over ``data`` on its rows ``b``."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(None, "data")))

    def _constrain(self, tree, rules: ShardingRules, kind: str, group: str):
        return jax.lax.with_sharding_constraint(tree, rules.shardings(self.mesh, kind, group, tree))


@functools.lru_cache(maxsize=64)
def make_layer_functions(layers: Layers, layout: Layout) -> LayerFunctions:
    """Builds the jitted per-layer functions of a layered model (cached, so engines share compiles).

    Example:
        >>> layout = Layout(ShardingRules.for_mesh(mesh, stage=3), mesh)
        >>> fns = make_layer_functions(model.layers(), layout)
        >>> h = fns.embed_fwd(p_embed, tokens[None])
    """
    rows = layout.rows

    def embed_fwd(p, x):
        p = layout.gather(p, "embed")
        return rows(jax.lax.map(lambda xa: layers.embed(p, xa), x))

    def block_fwd(p, h):
        p = layout.gather(p, "blocks")
        return rows(jax.lax.map(lambda ha: layers.block(p, ha), h))

    def head_fwd_bwd(ph, pe, h, y, scale):
        ph, pe = layout.gather(ph, "head"), layout.gather(pe, "embed")

        def one(args):
            ha, ya = args
            loss, vjp = jax.vjp(lambda a, b, c: layers.head(a, b, c, ya), ph, pe, ha)
            g_head, g_embed, dh = vjp(scale.astype(loss.dtype))
            return loss, dh, g_head, g_embed

        losses, dh, g_head, g_embed = jax.lax.map(one, (h, y))
        return jnp.mean(losses), rows(dh), layout.grads(_mean0(g_head), "head"), layout.grads(_mean0(g_embed), "embed")

    def block_bwd(p, h, dh):
        p = layout.gather(p, "blocks")

        def one(args):
            ha, da = args
            _, vjp = jax.vjp(layers.block, p, ha)
            g, dh_in = vjp(da)
            return dh_in, g

        dh_in, g = jax.lax.map(one, (h, dh))
        return rows(dh_in), layout.grads(_mean0(g), "blocks")

    def embed_bwd(p, x, dh):
        p = layout.gather(p, "embed")

        def one(args):
            xa, da = args
            _, vjp = jax.vjp(lambda q: layers.embed(q, xa), p)
            return vjp(da)[0]

        return layout.grads(_mean0(jax.lax.map(one, (x, dh))), "embed")

    return LayerFunctions(
        embed_fwd=jax.jit(embed_fwd),
        block_fwd=jax.jit(block_fwd),
        head_fwd_bwd=jax.jit(head_fwd_bwd),
        block_bwd=jax.jit(block_bwd),
        embed_bwd=jax.jit(embed_bwd),
    )
