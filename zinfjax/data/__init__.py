"""Token sources and deterministic, resumable batches.

- ``"demo"``: the embedded demo corpus, real English text that ships with Python
  (the pydoc topic help of the standard library);
- a ``.bin`` file: pre-tokenized ``uint16`` tokens (the nanoGPT format), memory-mapped;
- text: a ``.txt`` file, a directory of them or a glob; JSON Lines (``.jsonl``) or Parquet with a
  ``text`` field; or a ``datasets`` directory (`zinfjax.data.corpus`).

Text is tokenized by the model's tokenizer (`zinfjax.checkpoint.tokenizer.model_tokenizer`): a Hugging Face
tokenizer, into a memory-mapped token file cached beside the data (`zinfjax.data.corpus`); or bytes, for
the byte-vocabulary models and the models made from a config alone.

Batch ``n`` is a pure function of ``(seed, n)``, so the position saves and restores exactly.

Example:
    >>> batches = Batches(load_tokens("demo"), batch_size=8, seq_len=64, seed=0)
    >>> batch = next(batches)          # (8, 65) int32: inputs are [:, :-1], targets [:, 1:]
    >>> saved = batches.state()        # {"seed": 0, "position": 1}
"""

from zinfjax.data.batches import Batches, check_vocab, global_batch
from zinfjax.data.byte_text import BYTE_VOCAB, decode_bytes, demo_corpus, encode_bytes
from zinfjax.data.errors import DataError
from zinfjax.data.sources import load_tokens

__all__ = ["BYTE_VOCAB", "Batches", "DataError", "check_vocab", "decode_bytes", "demo_corpus", "encode_bytes",
           "global_batch", "load_tokens"]
