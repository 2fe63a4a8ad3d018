"""The Llama architecture in the layered convention.

RMSNorm, rotary position embeddings (the ``rotate_half`` form used by Hugging Face),
SwiGLU MLP, grouped-query attention, no biases and an untied output head.

Example:
    >>> model = Llama(ModelConfig.named("llama-tiny"))
    >>> params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((2, 8), jnp.int32))["params"]
    >>> params["blocks"]["q"]["kernel"].shape, params["blocks"]["k"]["kernel"].shape   # 16 query heads, 8 key-value
    ((4, 128, 16, 8), (4, 128, 8, 8))
"""

from __future__ import annotations

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinfjax.models import products
from zinfjax.models.attention import cached_attention, causal_attention
from zinfjax.models.configs import ModelConfig
from zinfjax.models.lora import adapted
from zinfjax.models.products import accumulator
from zinfjax.models.stacked import StackedLM
from zinfjax.models.tiling import DenseWeights, contract, tile_view, tiled_sum
from zinfjax.models.vocab import VocabTable, cross_entropy, lookup

Dtype = Any
normal = nn.initializers.normal


def rotary(x: jax.Array, theta: float, offset: Any = 0) -> jax.Array:
    """Applies rotary embeddings to (B, T, H, D) at positions ``offset, offset+1, ...`` (rotate-half layout)."""
    t, d = x.shape[1], x.shape[-1]
    wide = accumulator(x.dtype)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=wide) / d))
    angles = (offset + jnp.arange(t)).astype(wide)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x.astype(wide) * jnp.cos(angles) + rotated.astype(wide) * jnp.sin(angles)
    return out.astype(x.dtype)


class Embed(nn.Module):
    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, offset: Any = 0) -> jax.Array:
        c = self.config
        wte = VocabTable(c.vocab_size, c.d_model, name="wte")()
        return lookup(wte, tokens, c.chunks).astype(self.dtype)


class Block(nn.Module):
    """One Llama decoder block. ``__call__`` has the ``nn.scan`` signature; with a KV ``cache``, see gpt.Block."""

    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array, _: Any = None, cache: dict | None = None, pos: Any = 0) -> tuple[jax.Array, Any]:
        c = self.config
        if c.tiles > 1 and cache is None:
            return self._tiled(h), cache
        dense = partial(nn.DenseGeneral, use_bias=False, dtype=self.dtype, kernel_init=normal(0.02),
                        dot_general=products.dot_general)
        norm = partial(nn.RMSNorm, epsilon=c.norm_eps, dtype=self.dtype)
        x = norm(name="attn_norm")(h)
        offset = 0 if cache is None else pos
        qh, kvh, dt = (c.n_heads, c.head_dim), (c.kv_heads, c.head_dim), self.dtype
        q = rotary(adapted(c, "q", dense(qh, name="q")(x), x, qh, dtype=dt), c.rope_theta, offset)
        k = rotary(adapted(c, "k", dense(kvh, name="k")(x), x, kvh, dtype=dt), c.rope_theta, offset)
        v = adapted(c, "v", dense(kvh, name="v")(x), x, kvh, dtype=dt)
        if cache is None:
            a = causal_attention(q, k, v)
        else:
            a, cache = cached_attention(q, k, v, cache, pos)
        h = h + adapted(c, "o", dense(c.d_model, axis=(-2, -1), name="attn_out")(a), a, c.d_model, 2, dt)
        x = norm(name="mlp_norm")(h)
        gate = adapted(c, "gate", dense(c.d_ff, name="gate")(x), x, c.d_ff, dtype=dt)
        x = nn.silu(gate) * adapted(c, "up", dense(c.d_ff, name="up")(x), x, c.d_ff, dtype=dt)
        return h + adapted(c, "down", dense(c.d_model, name="down")(x), x, c.d_model, dtype=dt), cache

    def _tiled(self, h: jax.Array) -> jax.Array:
        """The block with its attention over ``tiles`` groups of query and key-value heads and its MLP over
        ``tiles`` tiles (`zinfjax.models.tiling`): the same parameters, the same values."""
        c, t, dt = self.config, self.config.tiles, self.dtype
        weights = partial(DenseWeights, kernel_init=normal(0.02), use_bias=False)
        norm = partial(nn.RMSNorm, epsilon=c.norm_eps, dtype=dt)
        wq = weights((c.d_model,), (c.n_heads, c.head_dim), name="q")()[0]
        wk, wv = (weights((c.d_model,), (c.kv_heads, c.head_dim), name=n)()[0] for n in ("k", "v"))
        wo = weights((c.n_heads, c.head_dim), (c.d_model,), name="attn_out")()[0]

        def group(x, wq_t, wk_t, wv_t, wo_t):
            q = rotary(contract(x, wq_t, 1, dt), c.rope_theta, 0)
            k = rotary(contract(x, wk_t, 1, dt), c.rope_theta, 0)
            return contract(causal_attention(q, k, contract(x, wv_t, 1, dt)), wo_t, 2, dt)

        views = (tile_view(wq, 1, t), tile_view(wk, 1, t), tile_view(wv, 1, t), tile_view(wo, 0, t))
        h = h + tiled_sum(group, norm(name="attn_norm")(h), views, dt)
        wg, wu = (weights((c.d_model,), (c.d_ff,), name=n)()[0] for n in ("gate", "up"))
        wd = weights((c.d_ff,), (c.d_model,), name="down")()[0]

        def mlp(x, wg_t, wu_t, wd_t):
            return contract(nn.silu(contract(x, wg_t, 1, dt)) * contract(x, wu_t, 1, dt), wd_t, 1, dt)

        return h + tiled_sum(mlp, norm(name="mlp_norm")(h), (tile_view(wg, 1, t), tile_view(wu, 1, t),
                                                              tile_view(wd, 0, t)), dt)


class Head(nn.Module):
    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array, embed_params: Any, targets: jax.Array | None = None) -> jax.Array:
        c = self.config
        h = nn.RMSNorm(epsilon=c.norm_eps, dtype=self.dtype, name="norm")(h)
        # The output projection is a (vocab, width) table, tied to the embedding or not, so it streams
        # in row chunks (models/vocab.py); Hugging Face's lm_head.weight has the same layout.
        table = embed_params["wte"]["embedding"] if c.tied else VocabTable(c.vocab_size, c.d_model, name="lm_head")()
        if targets is None:
            return jnp.einsum("btd,vd->btv", h, table.astype(self.dtype))
        return cross_entropy(h, table, targets, c.chunks, self.dtype)


# Megatron tensor parallelism over the ``model`` axis: q, k, v (query and key-value heads), gate
# and up are column-parallel; attn_out and down are row-parallel. With grouped-query attention the
# model axis must divide the key-value heads, so each device keeps its query heads' key-value
# heads. Embedding, norms and lm_head are not split. Specs are per layer (no layer axis).
PARTITION_RULES = (
    (r"(q|k|v)/kernel", (None, "model", None)),  # (D, heads, hd)
    (r"attn_out/kernel", ("model", None, None)),  # (H, hd, D)
    (r"(gate|up)/kernel", (None, "model")),  # (D, F)
    (r"down/kernel", ("model", None)),  # (F, D)
)


class Llama(StackedLM):
    """Llama: ``head(scan(block, embed(tokens)))``."""

    parts = (Embed, Block, Head)
    partition_rules = PARTITION_RULES
