"""The top level shared by the reference models: embed, ``nn.scan`` over stacked blocks, head."""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinfjax.models.configs import ModelConfig
from zinfjax.models.layered import Layers


class StackedLM(nn.Module):
    """``head(scan(block, embed(tokens)))``; subclasses name their ``Embed``, ``Block`` and ``Head`` modules.

    ``Head`` is called as ``Head(h, embed_params, targets)`` so a tied output projection can read the embedding.
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    parts: ClassVar[tuple[type, type, type]]
    partition_rules: ClassVar[tuple] = ()  # tensor parallelism; see `Layers.partition_rules`

    def setup(self):
        embed, block, head = self.parts
        c = self.config
        self.embed = embed(c, self.dtype)
        scan = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.n_layers)
        self.blocks = scan(c, self.dtype)
        self.head = head(c, self.dtype)

    def __call__(self, tokens: jax.Array, targets: jax.Array | None = None) -> jax.Array:
        h, _ = self.blocks(self.embed(tokens), None)
        return self.head(h, self.embed.variables["params"], targets)

    def layers(self) -> Layers:
        """The embed, block and head functions that zinfjax streams (cached per size)."""
        return _layers(self.parts, self.config, self.dtype, self.partition_rules)


@functools.cache
def _layers(parts: tuple[type, type, type], c: ModelConfig, dt, rules: tuple) -> Layers:
    embed, block, head = parts
    return Layers(
        embed=lambda p, tokens: embed(c, dt).apply({"params": p}, tokens),
        block=lambda p, h: block(c, dt).apply({"params": p}, h)[0],
        head=lambda ph, pe, h, targets: head(c, dt).apply({"params": ph}, h, pe, targets),
        partition_rules=rules,
    )
