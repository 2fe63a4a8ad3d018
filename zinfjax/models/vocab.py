"""The vocabulary in row chunks: an embedding lookup and a cross-entropy that never hold the whole table's work.

A language model's vocabulary table ``(V, D)`` is one of its largest tensors (GPT-2: 154 MB in
fp32; Llama-7B: 0.5 GB), and its logits ``(B, T, V)`` are larger still (823 MB in fp32 for batch 4
x 1024 tokens of GPT-2). Here both run as ``lax.scan`` over row chunks of the table (padded with
zero rows to ``chunks * rows``):

- `lookup` adds, chunk by chunk, the rows of the tokens that fall in the chunk: the same values as
  ``table[tokens]``, bit for bit;
- `cross_entropy` keeps an online log-sum-exp (running max, running sum) and the target logit
  across chunks, so the logits of one chunk exist at a time, forward and backward.

zinfjax streams a scan over a parameter's chunks like a scan over layers, so the table, its fp32
master and its optimizer state are read and updated one chunk at a time (docs/models.md).

Example (a table of 10 rows in 4 chunks of 3, the last padded; the same numbers as the whole table gives):
    >>> table = jax.random.normal(jax.random.key(0), (10, 8))
    >>> tokens, targets = jnp.array([[1, 9, 4]]), jnp.array([[9, 4, 0]])
    >>> h = lookup(table, tokens, chunks=4)
    >>> bool((h == table[tokens]).all())
    True
    >>> loss = cross_entropy(h, table, targets, chunks=4)
    >>> whole = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(h @ table.T), targets[..., None], axis=-1))
    >>> bool(jnp.allclose(loss, whole, rtol=1e-6))
    True
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinfjax.models.products import accumulator, dense

CHUNK_BYTES = 8 << 20  # fp32 bytes of one chunk of the table
MIN_CHUNKS = 4


def vocab_chunks(vocab: int, width: int, chunk_bytes: int = CHUNK_BYTES, minimum: int = MIN_CHUNKS) -> int:
    """How many row chunks a ``(vocab, width)`` table streams in: about ``chunk_bytes`` each, at least ``minimum``.

    A count that divides ``vocab`` (no padding) is preferred when one lies within twice the least.

    Example:
        >>> vocab_chunks(50257, 768)      # 29 chunks of 1733 rows: 50257 = 29 x 1733
        29
        >>> vocab_chunks(256, 64)
        4
    """
    least = min(vocab, max(minimum, math.ceil(vocab * width * 4 / chunk_bytes)))
    for count in range(least, min(vocab, 2 * least) + 1):
        if vocab % count == 0:
            return count
    return least


def _chunked(table: jax.Array, chunks: int) -> tuple[jax.Array, jax.Array, int]:
    """The table as ``(chunks, rows, D)`` (zero rows at the end), the first row of each chunk, and ``rows``."""
    vocab = table.shape[0]
    rows = -(-vocab // chunks)
    padded = jnp.pad(table, [(0, rows * chunks - vocab)] + [(0, 0)] * (table.ndim - 1))
    return padded.reshape(chunks, rows, *table.shape[1:]), jnp.arange(chunks) * rows, rows


def lookup(table: jax.Array, tokens: jax.Array, chunks: int) -> jax.Array:
    """``table[tokens]``, one row chunk of the table at a time."""
    parts, starts, rows = _chunked(table, chunks)

    def body(h, xs):
        part, start = xs
        local = tokens - start
        hit = (local >= 0) & (local < rows)
        rows_of = jnp.take(part, jnp.clip(local, 0, rows - 1), axis=0)
        return h + jnp.where(hit[..., None], rows_of, jnp.zeros((), table.dtype)), None

    h = jnp.zeros((*tokens.shape, table.shape[1]), table.dtype)
    return jax.lax.scan(body, h, (parts, starts))[0]


def cross_entropy(h: jax.Array, table: jax.Array, targets: jax.Array, chunks: int, dtype=None) -> jax.Array:
    """Mean token cross-entropy of logits ``h @ table.T`` (computed in float32), one row chunk at a time.

    The running maximum is a constant of the gradient (as in ``jax.nn.logsumexp``), so the
    backward pass of each chunk is its softmax minus the one-hot target, times the cotangent.
    """
    vocab = table.shape[0]
    parts, starts, rows = _chunked(table, chunks)
    dtype = dtype or h.dtype
    lead = h.shape[:-1]

    def body(carry, xs):
        high, total, picked = carry
        part, start = xs
        logits = dense(h, part.astype(dtype), w_rows=True).astype(wide)
        logits = jnp.where(start + jnp.arange(rows) < vocab, logits, -jnp.inf)
        new_high = jax.lax.stop_gradient(jnp.maximum(high, jnp.max(logits, axis=-1)))
        total = total * jnp.exp(high - new_high) + jnp.sum(jnp.exp(logits - new_high[..., None]), axis=-1)
        local = targets - start
        hit = (local >= 0) & (local < rows)
        mine = jnp.take_along_axis(logits, jnp.clip(local, 0, rows - 1)[..., None], axis=-1)[..., 0]
        return (new_high, total, picked + jnp.where(hit, mine, 0.0)), None

    wide = accumulator(dtype)
    init = (jnp.full(lead, -jnp.inf, wide), jnp.zeros(lead, wide), jnp.zeros(lead, wide))
    (high, total, picked), _ = jax.lax.scan(body, init, (parts, starts))
    return jnp.mean(high + jnp.log(total) - picked)


class VocabTable(nn.Module):
    """A ``(vocab, width)`` table parameter named ``embedding``: the token embedding, or an untied output head."""

    vocab: int
    width: int
    init: nn.initializers.Initializer = nn.initializers.normal(0.02)

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("embedding", self.init, (self.vocab, self.width))
