"""Tokenizers: bytes, or a Hugging Face tokenizer directory; and which one a model's text is tokenized with.

A model converted from Hugging Face keeps its tokenizer's files beside it (``zinfjax convert`` copies them
into ``<out>/tokenizer``), so text for it is tokenized as it was in pretraining. Bytes remain for the
byte-vocabulary models and for models made from a config alone, which have no tokenizer of their own.

Example:
    >>> load_tokenizer("bytes", 256).encode("Hi")
    [72, 105]
"""

from __future__ import annotations

import hashlib
import os

from zinfjax.data.byte_text import BYTE_VOCAB, decode_bytes, encode_bytes
from zinfjax.data.errors import DataError
from zinfjax.errors import ConfigError

# The files of a Hugging Face tokenizer: what `zinfjax convert` copies, and what its digest covers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")
SUBDIR = "tokenizer"  # where `zinfjax convert` keeps a converted model's tokenizer


class ByteTokenizer:
    """The byte-level tokenizer of the demo corpus and the byte-vocabulary models."""

    name, digest, vocab_size, eos_id = "bytes", "bytes", BYTE_VOCAB, None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in encode_bytes(text)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return decode_bytes(ids)


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (transformers, imported only here).

    ``encode_batch`` tokenizes documents as training data is: no special tokens added (an end-of-document
    token goes between documents instead, `zinfjax.data.corpus`).
    """

    def __init__(self, directory: str):
        from transformers import AutoTokenizer

        self.name = directory
        self._tok = AutoTokenizer.from_pretrained(directory)
        self.vocab_size = len(self._tok)
        self.eos_id = self._tok.eos_token_id
        self.digest = directory_digest(directory)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return self._tok.decode(ids)


def has_tokenizer(directory: str) -> bool:
    """Whether ``directory`` holds a Hugging Face tokenizer's files."""
    return os.path.isdir(directory) and any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def directory_digest(directory: str) -> str:
    """A digest of a tokenizer directory's files (names and contents): what a token cache is keyed by."""
    h = hashlib.blake2b(digest_size=16)
    for name in TOKENIZER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


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
    if has_tokenizer(name):
        try:
            return HFTokenizer(name)
        except (ImportError, OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer in {name}: {e}") from e
    raise ConfigError(f"unknown tokenizer {name!r}: use 'bytes' or a directory holding a Hugging Face tokenizer "
                      "(tokenizer.json), or pass --prompt-ids")


def beside(model: str) -> str | None:
    """The tokenizer kept beside a model given as a directory (a converted model, a checkpoint or a save_dir of
    them): ``<model>/tokenizer``, its parent's, or the directory itself when it is a Hugging Face model's."""
    if not os.path.isdir(model):
        return None
    model = os.path.abspath(model)
    for d in (os.path.join(model, SUBDIR), os.path.join(os.path.dirname(model), SUBDIR), model):
        if has_tokenizer(d):
            return d
    return None


def model_tokenizer(tokenizer: str | None, model: str, vocab_size: int):
    """The tokenizer a model's text is tokenized with: ``tokenizer`` when given (``bytes`` or a directory), else
    the one kept beside the model, else bytes for a model made from a config or of a byte vocabulary.

    Raises:
        DataError: a tokenizer with more tokens than the model's vocabulary, or a model directory of a larger
            vocabulary with no tokenizer beside it.
    """
    if tokenizer is None:
        tokenizer = beside(model)
        if tokenizer is None and os.path.isdir(model) and vocab_size != BYTE_VOCAB:
            raise DataError(f"the model in {model} has a vocabulary of {vocab_size} and no tokenizer beside it "
                            f"({model}/{SUBDIR}); give tokenizer=DIR (its Hugging Face tokenizer) or pre-tokenized "
                            "data (a .bin file)")
    tok = load_tokenizer(tokenizer or "bytes", vocab_size)
    if tok.vocab_size > vocab_size:
        raise DataError(f"the tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocabulary has "
                        f"{vocab_size}: they do not belong together; give the model's own tokenizer (tokenizer=DIR)")
    return tok
