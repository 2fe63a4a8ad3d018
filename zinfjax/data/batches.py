"""Deterministic, resumable batches: batch ``n`` of a token array is a pure function of ``(seed, n)``.

Example:
    >>> import numpy as np
    >>> b = Batches(np.arange(1000, dtype=np.uint16), 2, 8, seed=1)
    >>> first = next(b); b.restore({"seed": 1, "position": 0}); bool((next(b) == first).all())
    True
"""

from __future__ import annotations

import jax
import numpy as np

from zinfjax.data.errors import DataError


class Batches:
    """Random windows of ``seq_len + 1`` tokens; batch ``n`` depends only on ``(seed, n)``.

    Example:
        >>> b = Batches(np.arange(1000, dtype=np.uint16), 8, 64, seed=1)
        >>> first = next(b); b.restore({"seed": 1, "position": 0}); assert (next(b) == first).all()
        >>> first.shape, first.dtype
        ((8, 65), dtype('int32'))
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, position: int = 0):
        if len(tokens) < seq_len + 2:
            raise DataError(f"the data has {len(tokens)} tokens, fewer than seq_len+2={seq_len + 2}; give more data "
                            "or a smaller seq_len")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.position = seed, position

    def batch(self, n: int, rows: slice = slice(None)) -> np.ndarray:
        """Batch number ``n``, as int32 of shape (batch_size, seq_len + 1); or only its ``rows``.

        A process of a multi-process run reads only the rows its devices hold.
        """
        rng = np.random.default_rng([self.seed, n])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)[rows]
        out = np.empty((len(starts), self.seq_len + 1), np.int32)
        for row, s in enumerate(starts):
            out[row] = self.tokens[s : s + self.seq_len + 1]
        return out

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        out = self.batch(self.position)
        self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"seed": self.seed, "position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])


def check_vocab(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Refuses tokens that the model's vocabulary cannot embed."""
    top = int(np.max(tokens)) if len(tokens) else 0
    if top >= vocab_size:
        raise DataError(
            f"{source!r} has token id {top} but the model's vocabulary has {vocab_size} entries; "
            f"choose a model with a larger vocabulary"
        )


def global_batch(batches: Batches, sharding) -> jax.Array:
    """The next batch as one global array; each process reads only the rows its devices hold.

    Example:
        >>> from zinfjax.sharding import batch_sharding, make_mesh
        >>> batches = Batches(np.arange(1000, dtype=np.uint16), 8, 64)
        >>> batch = global_batch(batches, batch_sharding(make_mesh({"data": 1})))
        >>> batch.shape
        (8, 65)
    """
    n = batches.position
    batches.position += 1
    shape = (batches.batch_size, batches.seq_len + 1)
    return jax.make_array_from_callback(shape, sharding, lambda index: batches.batch(n, index[0])[:, index[1]])
