"""Token sources: ``demo``, a nanoGPT ``.bin`` file, or text tokenized by the model's tokenizer.

Example:
    >>> tokens = load_tokens("demo")            # the demo corpus, by bytes
    >>> int(tokens[0]) < 256
    True
"""

from __future__ import annotations

import os

import numpy as np

from zinfjax.data.batches import check_vocab
from zinfjax.data.byte_text import demo_corpus, encode_bytes
from zinfjax.data.corpus import encode_documents, is_dataset_dir, plain_text, source_paths, tokenized
from zinfjax.data.errors import DataError
from zinfjax.data.tokenizers import ByteTokenizer, model_tokenizer


def load_tokens(source: str, tokenizer=None, field: str = "text", progress: bool = False) -> np.ndarray:
    """Loads tokens from ``"demo"``, a nanoGPT ``.bin`` file, or text, tokenized by ``tokenizer`` (None: bytes).

    Plain text by bytes is read as it always was: the files joined by a blank line. Everything else goes
    through `zinfjax.data.corpus` (documents, each followed by the tokenizer's end-of-text token).

    Example:
        >>> tokens = load_tokens("data/train.bin")   # uint16, memory-mapped
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
        return encode_bytes(b"\n\n".join(_read(p) for p in paths))
    return tokenized(source, tokenizer, field, progress)


def model_tokens(source: str, model: str, vocab_size: int, tokenizer: str | None = None, field: str = "text",
                 progress: bool = False) -> tuple[np.ndarray, str]:
    """The tokens of ``source`` for the model ``model`` (a name, a file or a directory) and the tokenizer's name:
    ``.bin`` tokens as they are, text by the model's tokenizer (`zinfjax.data.tokenizers.model_tokenizer`).

    Raises:
        DataError: unreadable data, a tokenizer that is not the model's, or ids beyond its vocabulary.
    """
    if source.endswith(".bin"):
        tokens, name = _load_bin(source), "pre-tokenized"
    else:
        tok = model_tokenizer(tokenizer, model, vocab_size)
        tokens, name = load_tokens(source, tok, field, progress), tok.name
    check_vocab(tokens, vocab_size, source)
    return tokens, name


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


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"text file {path!r} cannot be read: {e.strerror or e}") from e
