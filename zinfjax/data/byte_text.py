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
    """The inverse of `encode_bytes`; invalid UTF-8 is replaced."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")
