"""Causal self-attention shared by the reference models."""

import jax
import jax.numpy as jnp


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention over (B, T, H, D) inputs; k and v may have fewer heads (GQA).

    Example:
        >>> out = causal_attention(q, k, v)   # (B, T, H, D)
    """
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * scale, k).astype(jnp.float32)
    t = q.shape[1]
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
