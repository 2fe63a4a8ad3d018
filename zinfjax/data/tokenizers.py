"""Tokenizers: bytes, or a Hugging Face tokenizer directory; and where a model keeps its own.

A model converted from Hugging Face keeps its tokenizer's files beside it (``zinfjax convert`` copies them
into ``<out>/tokenizer``), so text for it is tokenized as it was in pretraining. Bytes remain for the
byte-vocabulary models and for models made from a config alone, which have no tokenizer of their own. Which
tokenizer a run's model takes is one rule, `zinfjax.checkpoint.tokenizer.model_tokenizer`.

Example:
    >>> load_tokenizer("bytes", 256).encode("Hi")
    [72, 105]
"""

from __future__ import annotations

import hashlib
import os
import shutil

from zinfjax.data.byte_text import BYTE_VOCAB, decode_bytes, encode_bytes
from zinfjax.errors import ConfigError

# The files of a Hugging Face tokenizer: what `zinfjax convert` copies, and what its digest covers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model")
SUBDIR = "tokenizer"  # where `zinfjax convert` keeps a converted model's tokenizer
DATA_INSTEAD = "pre-tokenized data (a .bin file)"  # what text data can be given as without a tokenizer


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


def copy_tokenizer(src: str | None, dst: str) -> str | None:
    """Copies the Hugging Face tokenizer files of the directory ``src`` (if it holds a tokenizer) into ``dst``;
    returns ``dst``, or None when there was none. A converted model, and a run's checkpoints, keep their tokenizer
    so that their text is tokenized as in pretraining."""
    if src is None or not has_tokenizer(src):
        return None
    os.makedirs(dst, exist_ok=True)
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, name))
    return dst


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


def load_tokenizer(name: str, vocab_size: int, instead: str = DATA_INSTEAD):
    """``bytes`` or a tokenizer directory; anything else is refused with the choices. ``instead``: what the command
    takes in place of text, named when bytes cannot serve the model's vocabulary.

    Example:
        >>> load_tokenizer("bytes", 256).encode("Hi")
        [72, 105]
    """
    if name == "bytes":
        if vocab_size < BYTE_VOCAB:
            raise ConfigError(f"the byte tokenizer needs a vocabulary of {BYTE_VOCAB}; this model has {vocab_size}: "
                              f"give tokenizer=DIR (its Hugging Face tokenizer) or {instead}")
        return ByteTokenizer()
    if has_tokenizer(name):
        try:
            return HFTokenizer(name)
        except (ImportError, OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer in {name}: {e}") from e
    raise ConfigError(f"unknown tokenizer {name!r}: give tokenizer=bytes or tokenizer=DIR, a directory holding a "
                      "Hugging Face tokenizer (tokenizer.json)")


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
