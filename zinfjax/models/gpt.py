"""The GPT-2 architecture in the layered convention.

Learned positions, pre-LayerNorm, GELU MLP, biases, and an output projection tied
to the input embedding. All blocks are stacked on a leading layer axis (``nn.scan``).

Example:
    >>> model = GPT(ModelConfig.named("gpt2-tiny"))
    >>> tokens, targets = jnp.zeros((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
    >>> params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    >>> loss = jax.jit(model.apply)({"params": params}, tokens, targets)
    >>> sorted(params), params["blocks"]["fc"]["kernel"].shape, 5 < float(loss) < 6     # about ln 256 = 5.5
    (['blocks', 'embed', 'head'], (4, 64, 256), True)
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinfjax.models import products
from zinfjax.models.attention import cached_attention, causal_attention
from zinfjax.models.configs import ModelConfig
from zinfjax.models.lora import adapted
from zinfjax.models.stacked import StackedLM
from zinfjax.models.tiling import DenseWeights, add_bias, contract, tile_view, tiled_sum
from zinfjax.models.vocab import VocabTable, cross_entropy, lookup

Dtype = Any
normal = nn.initializers.normal


class Embed(nn.Module):
    """Token plus learned position embeddings."""

    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, offset: jax.Array | int = 0) -> jax.Array:
        c = self.config
        wte = VocabTable(c.vocab_size, c.d_model, name="wte")()
        wpe = nn.Embed(c.max_seq_len, c.d_model, embedding_init=normal(0.01), name="wpe")
        positions = (offset + jnp.arange(tokens.shape[1]))[None]
        return (lookup(wte, tokens, c.chunks) + wpe(positions)).astype(self.dtype)


class Block(nn.Module):
    """One pre-LayerNorm transformer block. ``__call__`` has the ``nn.scan`` signature.

    With a KV ``cache`` (decoding) the tokens of ``h`` sit at positions ``pos, pos+1, ...`` and the
    second result is the updated cache.
    """

    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array, _: Any = None, cache: dict | None = None, pos: Any = 0) -> tuple[jax.Array, Any]:
        c = self.config
        if c.tiles > 1 and cache is None:
            return self._tiled(h), cache
        dense = partial(nn.DenseGeneral, dtype=self.dtype, kernel_init=normal(0.02), dot_general=products.dot_general)
        out_init = normal(0.02 / math.sqrt(2 * c.n_layers))
        norm = partial(nn.LayerNorm, epsilon=c.norm_eps, dtype=self.dtype)
        x = norm(name="ln_1")(h)
        heads = (c.n_heads, c.head_dim)
        q, k, v = (adapted(c, n, dense(heads, name=n)(x), x, heads, dtype=self.dtype) for n in ("q", "k", "v"))
        if cache is None:
            a = causal_attention(q, k, v)
        else:
            a, cache = cached_attention(q, k, v, cache, pos)
        out = dense(c.d_model, axis=(-2, -1), kernel_init=out_init, name="attn_out")(a)
        h = h + adapted(c, "o", out, a, c.d_model, in_axes=2, dtype=self.dtype)
        x = norm(name="ln_2")(h)
        x = nn.gelu(adapted(c, "up", dense(c.d_ff, name="fc")(x), x, c.d_ff, dtype=self.dtype), approximate=True)
        h = h + adapted(c, "down", dense(c.d_model, kernel_init=out_init, name="proj")(x), x, c.d_model,
                        dtype=self.dtype)
        return h, cache

    def _tiled(self, h: jax.Array) -> jax.Array:
        """The block with its attention over ``tiles`` groups of heads and its MLP over ``tiles`` tiles
        (`zinfjax.models.tiling`): the same parameters, the same values."""
        c, t, dt = self.config, self.config.tiles, self.dtype
        out_init = normal(0.02 / math.sqrt(2 * c.n_layers))
        norm = partial(nn.LayerNorm, epsilon=c.norm_eps, dtype=dt)
        heads = (c.n_heads, c.head_dim)
        qkv = [DenseWeights((c.d_model,), heads, normal(0.02), name=n)() for n in ("q", "k", "v")]
        wo, bo = DenseWeights(heads, (c.d_model,), out_init, name="attn_out")()

        def group(x, wq, bq, wk, bk, wv, bv, wo_t):
            q, k, v = (add_bias(contract(x, w, 1, dt), b, dt) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
            return contract(causal_attention(q, k, v), wo_t, 2, dt)

        views = tuple(v for w, b in qkv for v in (tile_view(w, 1, t), tile_view(b, 0, t))) + (tile_view(wo, 0, t),)
        h = add_bias(h + tiled_sum(group, norm(name="ln_1")(h), views, dt), bo, dt)
        wf, bf = DenseWeights((c.d_model,), (c.d_ff,), normal(0.02), name="fc")()
        wp, bp = DenseWeights((c.d_ff,), (c.d_model,), out_init, name="proj")()

        def mlp(x, wf_t, bf_t, wp_t):
            return contract(nn.gelu(add_bias(contract(x, wf_t, 1, dt), bf_t, dt), approximate=True), wp_t, 1, dt)

        views = (tile_view(wf, 1, t), tile_view(bf, 0, t), tile_view(wp, 0, t))
        return add_bias(h + tiled_sum(mlp, norm(name="ln_2")(h), views, dt), bp, dt)


class Head(nn.Module):
    """Final LayerNorm and the tied output projection; returns the loss (over vocabulary chunks), or logits."""

    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array, embed_params: Any, targets: jax.Array | None = None) -> jax.Array:
        h = nn.LayerNorm(epsilon=self.config.norm_eps, dtype=self.dtype, name="ln_f")(h)
        wte = embed_params["wte"]["embedding"]
        if targets is None:
            return jnp.einsum("btd,vd->btv", h, wte.astype(self.dtype))
        return cross_entropy(h, wte, targets, self.config.chunks, self.dtype)


# Megatron tensor parallelism over the ``model`` axis: q, k, v and fc are column-parallel (split
# on heads / hidden units), attn_out and proj row-parallel (split on their input), so each block
# needs one all-reduce after attention and one after the MLP. Embedding, norms and output biases
# are not split. Specs are per layer (no layer axis).
PARTITION_RULES = (
    (r"(q|k|v)/kernel", (None, "model", None)),  # (D, H, hd): heads
    (r"(q|k|v)/bias", ("model", None)),  # (H, hd)
    (r"attn_out/kernel", ("model", None, None)),  # (H, hd, D)
    (r"fc/kernel", (None, "model")),  # (D, F): hidden units
    (r"fc/bias", ("model",)),  # (F,)
    (r"proj/kernel", ("model", None)),  # (F, D)
)


class GPT(StackedLM):
    """GPT-2: ``head(scan(block, embed(tokens)))``."""

    parts = (Embed, Block, Head)
    partition_rules = PARTITION_RULES
