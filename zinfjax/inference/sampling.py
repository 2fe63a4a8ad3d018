"""Choosing the next token: greedy, or temperature with top-k and top-p (nucleus) filtering."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from zinfjax.config import MAX_SEED
from zinfjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature=0`` is greedy (argmax); otherwise it samples.

    Example:
        >>> Sampling()                                      # greedy
        Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0)
        >>> Sampling(temperature=0.8, top_k=50, top_p=0.95, seed=1).top_k
        50
        >>> Sampling(top_p=0)
        Traceback (most recent call last):
        zinfjax.errors.ConfigError: top_p=0 must be in (0, 1]
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature={self.temperature} must be 0 (greedy) or a positive, finite number")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed={self.seed} must be between 0 and 2**63-1")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be 0 (off) or positive")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def next_tokens(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """The next token of each row of ``logits`` (B, V).

    Example:
        >>> logits = jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
        >>> next_tokens(logits, jax.random.key(0), 0.0, 0, 1.0).tolist()    # greedy
        [1, 0]
        >>> next_tokens(logits, jax.random.key(0), 1.0, 1, 1.0).tolist()    # sampled from the top 1: the same
        [1, 0]
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p  # always keeps the most likely token
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
