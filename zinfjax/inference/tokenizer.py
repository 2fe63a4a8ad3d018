"""Tokenizers for ``zinfjax generate``: bytes, or a Hugging Face tokenizer directory."""

from __future__ import annotations

import os

from zinfjax.data import BYTE_VOCAB, decode_bytes, encode_bytes
from zinfjax.errors import ConfigError


class ByteTokenizer:
    """The byte-level tokenizer of the demo corpus and the byte-vocabulary models."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in encode_bytes(text)]

    def decode(self, ids) -> str:
        return decode_bytes(ids)


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (transformers, imported only here)."""

    def __init__(self, directory: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(directory)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids) -> str:
        return self._tok.decode(ids)


def load_tokenizer(name: str, vocab_size: int):
    """``bytes`` or a tokenizer directory; anything else is refused with the choices.

    Example:
        >>> load_tokenizer("bytes", 256).encode("Hi")
        [72, 105]
    """
    if name == "bytes":
        if vocab_size < BYTE_VOCAB:
            raise ConfigError(f"the byte tokenizer needs a vocabulary of {BYTE_VOCAB}; this model has {vocab_size}: "
                              "give --tokenizer DIR or --prompt-ids")
        return ByteTokenizer()
    if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f))
                                   for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json")):
        try:
            return HFTokenizer(name)
        except (ImportError, OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer in {name}: {e}") from e
    raise ConfigError(f"unknown tokenizer {name!r}: use 'bytes' or a directory holding a Hugging Face tokenizer "
                      "(tokenizer.json), or pass --prompt-ids")
