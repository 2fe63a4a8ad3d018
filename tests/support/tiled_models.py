"""A user's Linen language model with tiled MLPs: blocks ``nn.scan``-ned over layers, each with a `TiledMLP` inside.

Two nested scans over parameters: the blocks (``blocks/...``, leading axis ``n_layers``) and, inside each, the
MLP's tiles (``blocks/mlp/tiles/w_in`` ``(n_layers, tiles, d_model, d_ff/tiles)``). The model is written as a
user would, from flax and `zinfjax.TiledMLP` alone; tests of the modules train it in memory, and the engine's
tests stream it tile by tile.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from zinfjax import TiledMLP


@dataclasses.dataclass(frozen=True)
class TiledLMConfig:
    vocab: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    tiles: int = 4


SMALL = TiledLMConfig()


class TiledBlock(nn.Module):
    """Pre-LayerNorm causal self-attention, then the tiled MLP; ``__call__`` has the ``nn.scan`` signature."""

    config: TiledLMConfig

    @nn.compact
    def __call__(self, h: jax.Array, _=None) -> tuple[jax.Array, None]:
        c = self.config
        x = nn.LayerNorm(name="ln_1")(h)
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2], jnp.int32))
        h = h + nn.MultiHeadDotProductAttention(num_heads=c.n_heads, name="attn")(x, x, mask=mask)
        return h + TiledMLP(c.d_ff, c.tiles, name="mlp")(nn.LayerNorm(name="ln_2")(h)), None


class TiledBlockLM(nn.Module):
    """Embedding, ``nn.scan`` over `TiledBlock`s, final LayerNorm and an untied head: logits ``(B, T, vocab)``."""

    config: TiledLMConfig = SMALL

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        h = nn.Embed(c.vocab, c.d_model, name="embed")(tokens)
        blocks = nn.scan(TiledBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.n_layers)
        h, _ = blocks(c, name="blocks")(h, None)
        return nn.Dense(c.vocab, name="head")(nn.LayerNorm(name="ln_f")(h))


def lm_loss(model: TiledBlockLM):
    """``loss(params, tokens)``: the mean next-token cross-entropy of ``tokens`` ``(B, T+1)``."""

    def loss(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def init_params(model: TiledBlockLM, rng: jax.Array, seq_len: int = 8):
    """The model's parameters for token windows of ``seq_len``."""
    return model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]
