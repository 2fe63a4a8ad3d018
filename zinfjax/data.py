"""Token sources and deterministic, resumable batches.

- ``"demo"``: the embedded demo corpus, real English text that ships with Python
  (the pydoc topic help of the standard library), tokenized by bytes.
- a ``.bin`` file: pre-tokenized ``uint16`` tokens (the nanoGPT format), memory-mapped;
- any other path (a text file, a directory of ``.txt`` files, or a glob): text, tokenized by bytes.

Batch ``n`` is a pure function of ``(seed, n)``, so the position saves and restores exactly.

Example:
    >>> batches = Batches(load_tokens("demo"), batch_size=8, seq_len=64, seed=0)
    >>> batch = next(batches)          # (8, 65) int32: inputs are [:, :-1], targets [:, 1:]
    >>> saved = batches.state()        # {"seed": 0, "position": 1}
"""

from __future__ import annotations

import glob
import os

import jax
import numpy as np

from zinfjax.errors import UserError

BYTE_VOCAB = 256


class DataError(UserError):
    """A data source that cannot be read or does not fit the model."""


def demo_corpus() -> bytes:
    """The embedded demo corpus: about 460 KB of English text from Python's own help topics."""
    from pydoc_data.topics import topics  # lazy: 700 KB of help text, loaded only for the demo corpus

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def encode_bytes(text: str | bytes) -> np.ndarray:
    """Byte-level tokenization: every UTF-8 byte is one token in a vocabulary of 256."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)


def decode_bytes(tokens) -> str:
    """The inverse of `encode_bytes`; invalid UTF-8 is replaced."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def load_tokens(source: str) -> np.ndarray:
    """Loads tokens from ``"demo"``, a nanoGPT ``.bin`` file, or text files.

    Example:
        >>> tokens = load_tokens("data/train.bin")   # uint16, memory-mapped
    """
    if source == "demo":
        return encode_bytes(demo_corpus())
    if source.endswith(".bin"):
        return _load_bin(source)
    paths = _text_paths(source)
    return encode_bytes(b"\n\n".join(_read(p) for p in paths))


def _load_bin(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise DataError(f"token file {path!r} does not exist")
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"token file {path!r} is empty; a .bin file holds uint16 tokens")
    if size % 2:
        raise DataError(f"token file {path!r} has an odd size; a .bin file holds uint16 tokens")
    try:
        return np.memmap(path, dtype=np.uint16, mode="r")
    except OSError as e:
        raise DataError(f"token file {path!r} cannot be read: {e.strerror or e}") from e


def _text_paths(source: str) -> list[str]:
    if os.path.isdir(source):
        paths = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
    else:
        paths = sorted(glob.glob(source))
    if not paths:
        raise DataError(f"no text found at {source!r}; give 'demo', a .bin token file, a .txt file, "
                        f"a directory of .txt files or a glob")
    return paths


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"text file {path!r} cannot be read: {e.strerror or e}") from e


class Batches:
    """Random windows of ``seq_len + 1`` tokens; batch ``n`` depends only on ``(seed, n)``.

    Example:
        >>> b = Batches(tokens, 8, 64, seed=1)
        >>> first = next(b); b.restore({"seed": 1, "position": 0}); assert (next(b) == first).all()
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
        >>> global_batch(Batches(tokens, 8, 64), batch_sharding(mesh)).shape
        (8, 65)
    """
    n = batches.position
    batches.position += 1
    shape = (batches.batch_size, batches.seq_len + 1)
    return jax.make_array_from_callback(shape, sharding, lambda index: batches.batch(n, index[0])[:, index[1]])
