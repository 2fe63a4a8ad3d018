"""The tokenizer of the model a run names, found by one rule for every command that turns text into ids or back.

``zinfjax train`` and ``zinfjax evaluate`` tokenize text data with it, ``zinfjax generate`` its prompt and
output, and ``zinfjax convert`` carries its files along (docs/data.md, "The model's own tokenizer"):

1. ``tokenizer`` when given (``--set tokenizer=...``, or generate's ``--tokenizer``, the same setting):
   ``bytes`` or a Hugging Face tokenizer directory;
2. else the one kept beside the model (`zinfjax.data.tokenizers.beside`) or, for a run that trained adapters
   on a frozen base (its checkpoints name the base), the one kept beside that base;
3. else bytes, for a model made from a config (a named size, a ModelConfig file) or of a byte vocabulary.

A model directory of a larger vocabulary with none found is refused, and so is a tokenizer with more tokens
than the model's vocabulary.

Example:
    >>> model_tokenizer(None, "gpt2-tiny", 256).name      # a model made from a config: bytes
    'bytes'
    >>> import numpy as np, tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> gpt2 = tempfile.mkdtemp()                           # a converted model, its tokenizer's files beside it
    >>> path = write_params(gpt2, {"w": np.ones(4, np.float32)})
    >>> os.makedirs(f"{gpt2}/tokenizer"); open(f"{gpt2}/tokenizer/tokenizer.json", "w").close()
    >>> tokenizer_dir(path) == f"{gpt2}/tokenizer"
    True
    >>> model_tokenizer(None, tempfile.mkdtemp(), 50257)  # GPT-2's vocabulary, and no tokenizer found
    Traceback (most recent call last):
    zinfjax.data.errors.DataError: the model in ... has a vocabulary of 50257 and no tokenizer beside it ...
"""

from __future__ import annotations

import os

import numpy as np

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointNotFoundError
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.data import check_vocab, load_tokens
from zinfjax.data.byte_text import BYTE_VOCAB
from zinfjax.data.errors import DataError
from zinfjax.data.tokenizers import DATA_INSTEAD, SUBDIR, beside, copy_tokenizer, load_tokenizer


def tokenizer_dir(model: str) -> str | None:
    """The Hugging Face tokenizer directory kept with the model ``model`` names (rule 2 of the module docstring), or
    None where there is none: a named size, a model file, a directory without one."""
    found = beside(model)
    if found is None:
        base = _base(model)
        found = tokenizer_dir(base) if base else None
    return found


def keep_tokenizer(save_dir: str, model: str, tokenizer: str | None) -> str | None:
    """Keeps a run's Hugging Face tokenizer (``tokenizer=DIR``, else the one kept with its model) in
    ``<save_dir>/tokenizer``, unless one is found beside the save_dir already (a run saved where its model is):
    the run's checkpoints are then read as text by the tokenizer they were trained with (`zinfjax evaluate`,
    `zinfjax generate`, `zinfjax convert --to hf`), as a converted model's are. Returns where it was kept, or None.
    A run whose checkpoints name a frozen base keeps none: its tokenizer is found beside that base."""
    source = tokenizer if tokenizer is not None else tokenizer_dir(model)
    if source in (None, "bytes") or beside(save_dir) is not None:
        return None
    return copy_tokenizer(source, os.path.join(save_dir, SUBDIR))


def model_tokenizer(tokenizer: str | None, model: str, vocab_size: int, instead: str = DATA_INSTEAD):
    """The tokenizer the text of ``model`` (a name, a file or a directory) is tokenized with (module docstring).

    ``instead``: what the command takes in place of text, named in the error when no tokenizer is found.

    Raises:
        DataError: a model directory of a larger vocabulary with no tokenizer found, or a tokenizer with more
            tokens than the model's vocabulary.
        ConfigError: ``tokenizer`` is neither ``bytes`` nor a tokenizer directory.
    """
    if tokenizer is None:
        tokenizer = tokenizer_dir(model)
        if tokenizer is None and os.path.isdir(model) and vocab_size != BYTE_VOCAB:
            raise DataError(f"the model in {model} has a vocabulary of {vocab_size} and no tokenizer beside it "
                            f"({model}/{SUBDIR}) or beside a base it names; give tokenizer=DIR (its Hugging Face "
                            f"tokenizer) or {instead}")
    tok = load_tokenizer(tokenizer or "bytes", vocab_size, instead)
    if tok.vocab_size > vocab_size:
        raise DataError(f"the tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocabulary has "
                        f"{vocab_size}: they do not belong together; give the model's own tokenizer (tokenizer=DIR)")
    return tok


def model_tokens(source: str, model: str, vocab_size: int, tokenizer: str | None = None, field: str = "text",
                 progress: bool = False) -> tuple[np.ndarray, str]:
    """The tokens of ``source`` for the model ``model`` and the tokenizer's name: ``.bin`` ids as they are, text by
    the model's tokenizer (`model_tokenizer`).

    Raises:
        DataError: unreadable data, a tokenizer that is not the model's, or ids beyond its vocabulary.
    """
    if source.endswith(".bin"):
        tokens, name = load_tokens(source), "pre-tokenized"
    else:
        tok = model_tokenizer(tokenizer, model, vocab_size)
        tokens, name = load_tokens(source, tok, field, progress), tok.name
    check_vocab(tokens, vocab_size, source)
    return tokens, name


def _base(model: str) -> str | None:
    """The frozen base a zinfjax checkpoint (or save_dir) names, or None: no base, or no zinfjax checkpoint."""
    if not os.path.isdir(model):
        return None
    try:
        directory = latest_checkpoint(model)
    except CheckpointNotFoundError:  # another kind of directory: a Hugging Face model's, a DeepSpeed run's
        return None
    return fmt.read_meta(directory).get("base", {}).get("path")
