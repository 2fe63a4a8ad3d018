"""Softmax attention shared by the reference models: causal (GPT-2, Llama) and padded (BERT)."""

import jax
import jax.numpy as jnp

from zinfjax.models.products import accumulator


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention over (B, T, H, D) inputs; k and v may have fewer heads (GQA).

    Example (8 query heads over 2 key-value heads):
        >>> q, kv = jnp.ones((2, 5, 8, 16)), jnp.ones((2, 5, 2, 16))      # (B, T, H, D)
        >>> out = causal_attention(q, kv, jnp.arange(5.0)[None, :, None, None] * kv)      # v_t = t
        >>> [round(x, 4) for x in out[0, :, 0, 0].tolist()]      # equal scores: the mean of v over t' <= t
        [0.0, 0.5, 1.0, 1.5, 2.0]
    """
    t = q.shape[1]
    return _attend(q, k, v, jnp.tril(jnp.ones((t, t), dtype=bool)))


def padded_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_mask: jax.Array) -> jax.Array:
    """Bidirectional softmax attention over (B, T, H, D) inputs; keys where ``key_mask`` (B, T) is False are ignored.

    Example (the last two tokens are padding):
        >>> q = k = jnp.ones((1, 4, 2, 8))
        >>> v = jnp.arange(4.0)[None, :, None, None] * jnp.ones((1, 4, 2, 8))
        >>> attention_mask = jnp.array([[1, 1, 0, 0]])
        >>> out = padded_attention(q, k, v, attention_mask.astype(bool))   # (B, T, H, D)
        >>> [round(x, 4) for x in out[0, :, 0, 0].tolist()]              # the mean of v over the real tokens
        [0.5, 0.5, 0.5, 0.5]
    """
    return _attend(q, k, v, key_mask[:, None, None, :])


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache: dict, pos: jax.Array):
    """Causal attention of new tokens at positions ``pos, pos+1, ...`` over a KV cache; returns (out, cache).

    ``cache`` holds ``k`` and ``v`` of shape (B, T_max, H_kv, D); the new keys and values are written
    at ``pos`` first, and each new token attends to every position up to its own.

    Example (the token at position 7 of a cache of 16):
        >>> ck = cv = jnp.zeros((1, 16, 2, 8))
        >>> q, k, v = jnp.zeros((1, 1, 2, 8)), jnp.ones((1, 1, 2, 8)), jnp.ones((1, 1, 2, 8))   # (B, 1, H, D)
        >>> out, cache = cached_attention(q, k, v, {"k": ck, "v": cv}, jnp.int32(7))
        >>> out.shape, float(cache["v"][0, 7, 0, 0]), float(out[0, 0, 0, 0])   # an even mean over positions 0..7
        ((1, 1, 2, 8), 1.0, 0.125)
    """
    k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), pos, axis=1)
    v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), pos, axis=1)
    q_pos = pos + jnp.arange(q.shape[1])
    mask = jnp.arange(k.shape[1])[None, :] <= q_pos[:, None]
    return _attend(q, k.astype(q.dtype), v.astype(q.dtype), mask), {"k": k, "v": v}


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = jnp.repeat(k, groups, axis=2)
        v = jnp.repeat(v, groups, axis=2)
    wide = accumulator(q.dtype)
    scale = 1.0 / jnp.sqrt(jnp.asarray(q.shape[-1], wide)).astype(q.dtype)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * scale, k).astype(wide)
    scores = jnp.where(mask, scores, jnp.finfo(wide).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
