"""The BERT encoder in the layered convention.

Word, position and token-type embeddings with a LayerNorm; post-LayerNorm blocks with
bidirectional attention over the real (unpadded) tokens and an exact (erf) GELU MLP; a head
that returns the final hidden states and the pooler output. There is no training loss:
the encoder computes hidden states and, with `mean_pool`, sentence embeddings.

The attention mask travels between blocks with the hidden states (`Hidden`), so a block
keeps the ``block(p, h) -> h`` signature of the convention.

Example (a BERT of 2 layers of width 32; `zinfjax convert` reads a real one's config from Hugging Face):
    >>> config = ModelConfig("bert", vocab_size=100, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    >>> model = Bert(config)
    >>> ids = jnp.array([[5, 6, 7, 0], [8, 9, 0, 0]])
    >>> attention_mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])          # the 0s are padding
    >>> batch = BertInputs(ids, attention_mask, jnp.zeros_like(ids))
    >>> params = jax.jit(model.init)(jax.random.key(0), batch)["params"]
    >>> out = jax.jit(model.apply)({"params": params}, batch)
    >>> sentences = mean_pool(out.hidden, attention_mask)
    >>> out.hidden.shape, sentences.shape                               # (B, T, D) and (B, D)
    ((2, 4, 32), (2, 32))
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinfjax.models import products
from zinfjax.models.attention import padded_attention
from zinfjax.models.configs import ModelConfig
from zinfjax.models.gpt import PARTITION_RULES
from zinfjax.models.layered import LayeredConventionError
from zinfjax.models.stacked import StackedLM

Dtype = Any
normal = nn.initializers.normal


class BertInputs(NamedTuple):
    """A padded batch: token ids, attention mask (1 for real tokens, 0 for padding) and token types, all (B, T)."""

    ids: jax.Array
    mask: jax.Array
    types: jax.Array


class Hidden(NamedTuple):
    """What flows between blocks: hidden states (B, T, D) and which tokens are real (B, T, bool)."""

    states: jax.Array
    mask: jax.Array


class BertOutput(NamedTuple):
    """The encoder's output: final hidden states (B, T, D) and the pooler output (B, D)."""

    hidden: jax.Array
    pooled: jax.Array


def bert_inputs(tokens: jax.Array | BertInputs) -> BertInputs:
    """``tokens`` as `BertInputs`; a bare (B, T) array of ids means no padding and token type 0.

    Example:
        >>> inputs = bert_inputs(jnp.array([[5, 6, 7]]))
        >>> bool(inputs.mask.all()), inputs.types.tolist()
        (True, [[0, 0, 0]])
    """
    if isinstance(tokens, BertInputs):
        return tokens
    ones = jnp.ones(tokens.shape, jnp.int32)
    return BertInputs(tokens, ones, jnp.zeros_like(ones))


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """The mean of ``hidden`` (B, T, D) over the real tokens of ``mask`` (B, T): sentence embeddings.

    Example (two tokens of the first sentence and one of the second are real):
        >>> hidden = jnp.arange(12.0).reshape(2, 3, 2)          # (B, T, D)
        >>> mean_pool(hidden, jnp.array([[1, 1, 0], [1, 0, 0]])).tolist()
        [[1.0, 2.0], [6.0, 7.0]]
    """
    m = mask.astype(hidden.dtype)[..., None]
    return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)


def _layer_norm(c: ModelConfig, dtype: Dtype, name: str) -> nn.LayerNorm:
    # Two-pass variance, as torch computes it: BERT's eps (1e-12) leaves nothing to hide the difference.
    return nn.LayerNorm(epsilon=c.norm_eps, dtype=dtype, use_fast_variance=False, name=name)


class Embed(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm; carries the mask on."""

    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array | BertInputs) -> Hidden:
        c = self.config
        x = bert_inputs(tokens)
        embed = partial(nn.Embed, features=c.d_model, embedding_init=normal(0.02))
        positions = jnp.arange(x.ids.shape[1])[None]
        h = (
            embed(c.vocab_size, name="word")(x.ids)
            + embed(c.max_seq_len, name="position")(positions)
            + embed(c.type_vocab_size, name="token_type")(x.types)
        )
        return Hidden(_layer_norm(c, self.dtype, "norm")(h.astype(self.dtype)), x.mask.astype(bool))


class Block(nn.Module):
    """One post-LayerNorm BERT layer. ``__call__`` has the ``nn.scan`` signature."""

    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: Hidden, _: Any = None) -> tuple[Hidden, None]:
        c = self.config
        dense = partial(nn.DenseGeneral, dtype=self.dtype, kernel_init=normal(0.02), dot_general=products.dot_general)
        x, mask = h
        q, k, v = (dense((c.n_heads, c.head_dim), name=n)(x) for n in ("q", "k", "v"))
        a = dense(c.d_model, axis=(-2, -1), name="attn_out")(padded_attention(q, k, v, mask))
        x = _layer_norm(c, self.dtype, "attn_norm")(x + a)
        y = nn.gelu(dense(c.d_ff, name="fc")(x), approximate=False)
        x = _layer_norm(c, self.dtype, "mlp_norm")(x + dense(c.d_model, name="proj")(y))
        return Hidden(x, mask), None


class Head(nn.Module):
    """The final hidden states and the pooler (tanh of a dense layer on the first token)."""

    config: ModelConfig
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h: Hidden, embed_params: Any, targets: jax.Array | None = None) -> BertOutput:
        if targets is not None:
            raise LayeredConventionError(
                "the BERT encoder has no training loss: call it without targets and use its hidden states"
            )
        pooler = nn.Dense(self.config.d_model, dtype=self.dtype, kernel_init=normal(0.02), name="pooler")
        return BertOutput(h.states, jnp.tanh(pooler(h.states[:, 0])))


class Bert(StackedLM):
    """BERT encoder: ``head(scan(block, embed(tokens)))``; ``tokens`` is (B, T) ids or `BertInputs`."""

    causal = False  # an encoder: no token-by-token decoding

    parts = (Embed, Block, Head)
    partition_rules = PARTITION_RULES  # the same q, k, v, attn_out, fc, proj split as GPT-2
