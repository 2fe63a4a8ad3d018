"""Softmax attention shared by the reference models: causal (GPT-2, Llama) and padded (BERT)."""

import jax
import jax.numpy as jnp


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention over (B, T, H, D) inputs; k and v may have fewer heads (GQA).

    Example:
        >>> out = causal_attention(q, k, v)   # (B, T, H, D)
    """
    t = q.shape[1]
    return _attend(q, k, v, jnp.tril(jnp.ones((t, t), dtype=bool)))


def padded_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array) -> jax.Array:
    """Bidirectional softmax attention over (B, T, H, D) inputs; keys where ``key_mask`` (B, T) is False are ignored.

    Example:
        >>> out = padded_attention(q, k, v, attention_mask.astype(bool))   # (B, T, H, D)
    """
    return _attend(q, k, v, key_mask[:, None, None, :])


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * scale, k).astype(jnp.float32)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
