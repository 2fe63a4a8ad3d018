"""Token sources: ``demo``, a nanoGPT ``.bin`` file, or text tokenized by the model's tokenizer.

Example:
    >>> tokens = load_tokens("demo")            # the demo corpus, by bytes
    >>> int(tokens[0]) < 256
    True
"""

from __future__ import annotations

import os

import numpy as np

from zinfjax.data.byte_text import demo_corpus, encode_bytes
from zinfjax.data.corpus import (
    decode_text,
    encode_documents,
    is_dataset_dir,
    no_text,
    plain_text,
    source_paths,
    tokenized,
)
from zinfjax.data.errors import DataError
from zinfjax.data.tokenizers import ByteTokenizer


def load_tokens(source: str, tokenizer=None, field: str = "text", progress: bool = False) -> np.ndarray:
    """Loads tokens from ``"demo"``, a nanoGPT ``.bin`` file, or text, tokenized by ``tokenizer`` (None: bytes).

    Plain text by bytes is read as it always was: the files joined by a blank line. Everything else goes
    through `zinfjax.data.corpus` (documents, each followed by the tokenizer's end-of-text token).

    Example:
        >>> import numpy as np, tempfile
        >>> train = f"{tempfile.mkdtemp()}/train.bin"           # nanoGPT's format: uint16 token ids
        >>> np.arange(1000, dtype=np.uint16).tofile(train)
        >>> tokens = load_tokens(train)                          # memory-mapped
        >>> tokens.dtype, len(tokens), type(tokens).__name__
        (dtype('uint16'), 1000, 'memmap')
    """
    if source.endswith(".bin"):
        return _load_bin(source)
    tokenizer = tokenizer or ByteTokenizer()
    if source == "demo":
        if tokenizer.name == "bytes":
            return encode_bytes(demo_corpus())
        return np.asarray(encode_documents(tokenizer, [demo_corpus().decode("utf-8")]), np.uint32)
    paths = source_paths(source)
    if tokenizer.name == "bytes" and not is_dataset_dir(source) and all(plain_text(p) for p in paths):
        texts = [_read_text(p) for p in paths]
        if not any(texts):
            raise no_text(source)
        return encode_bytes(b"\n\n".join(texts))
    return tokenized(source, tokenizer, field, progress)


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


def _read_text(path: str) -> bytes:
    """The bytes of the text file ``path``, checked to be UTF-8 (`decode_text`), as every tokenizer reads text."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"text file {path!r} cannot be read: {e.strerror or e}") from e
    decode_text(data, path)
    return data
