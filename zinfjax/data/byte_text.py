"""Text as bytes: the byte-level tokenization of the byte-vocabulary models, and the embedded demo corpus.

Example:
    >>> decode_bytes(encode_bytes("héllo"))
    'héllo'
"""

from __future__ import annotations

import numpy as np

BYTE_VOCAB = 256


def demo_corpus() -> bytes:
    """The embedded demo corpus: about 460 KB of English text from Python's own help topics."""
    from pydoc_data.topics import topics  # lazy: 700 KB of help text, loaded only for the demo corpus

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def encode_bytes(text: str | bytes) -> np.ndarray:
    """Byte-level tokenization: every UTF-8 byte is one token in a vocabulary of 256."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)


def decode_bytes(tokens) -> str:
    """The inverse of `encode_bytes`; invalid UTF-8, and an id past the bytes (a model of a larger vocabulary), is
    replaced (U+FFFD)."""
    ids = np.asarray(tokens, dtype=np.int64).ravel()
    ids = np.where((ids < 0) | (ids >= BYTE_VOCAB), 0xFF, ids)  # 0xFF is never UTF-8: it decodes as U+FFFD
    return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")
