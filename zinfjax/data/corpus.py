"""Text for a model with a tokenizer of its own: read as documents, tokenized once into a memory-mapped token file.

Sources (``data=``), each read a piece at a time, never whole:

- text: a ``.txt`` file, a directory of them, or a glob. A file is one document, read in pieces of about
  1 MiB cut where a line starts with a character that is not white space: a byte-level BPE (GPT-2's)
  splits words there anyway, so the ids are those of the whole file;
- JSON Lines (``.jsonl``): one document a line, its ``field`` (``data_field``, default ``text``);
- Parquet (``.parquet``): the ``field`` column, a record batch at a time (pyarrow);
- a ``datasets`` directory (``Dataset.save_to_disk``; a ``DatasetDict``'s ``train`` split): the ``field``
  column, memory-mapped by Arrow.

Each document is ``tokenizer(text, add_special_tokens=False)`` followed by the tokenizer's end-of-text
token, if it has one. The tokens are written once to ``.zinfjax-tokens/`` beside the data (or, where that
cannot be written, under ``$XDG_CACHE_HOME/zinfjax/tokens``), named by the data's digest and the
tokenizer's, and memory-mapped from there: batch ``n`` stays a function of ``(seed, n)``, and a second run
on the same data and tokenizer reads the file instead of tokenizing again.

Example (bytes here; a converted model's Hugging Face tokenizer is ``HFTokenizer(directory)``):
    >>> import tempfile
    >>> from zinfjax.data.tokenizers import load_tokenizer
    >>> notes = f"{tempfile.mkdtemp()}/notes.jsonl"
    >>> with open(notes, "w") as f:
    ...     f.writelines(json.dumps({"text": text}) + "\\n" for text in ("Hi", "there"))
    >>> tokens = tokenized(notes, load_tokenizer("bytes", 256))
    >>> tokens.tolist(), tokens.dtype
    ([72, 105, 116, 104, 101, 114, 101], dtype('uint16'))
    >>> tokens.filename
    '/.../.zinfjax-tokens/notes.jsonl-...-bytes-text.u2'
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator

import numpy as np
from tqdm import tqdm

from zinfjax.data.errors import DataError

PIECE = 1 << 20  # bytes of text tokenized at once
BATCH = 256  # documents tokenized at once (a fast tokenizer encodes a batch in parallel)
CACHE_DIR = ".zinfjax-tokens"
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_dataset_dir(path: str) -> bool:
    """Whether ``path`` is a directory that ``datasets.Dataset.save_to_disk`` wrote."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in DATASET_MARKERS)


SOURCES = ("give 'demo', a .bin token file, a .txt, .jsonl or .parquet file, a directory of .txt files, a glob of "
           "such files, or a datasets directory (save_to_disk)")
TEXT_FILES = (".txt", ".jsonl", ".parquet")  # the files read as text data, by their extension (docs/data.md)


def source_paths(source: str) -> list[str]:
    """The files ``source`` names: itself, a directory's ``.txt`` files, or a glob's matches.

    Raises:
        DataError: nothing there, or a file of another kind than ``TEXT_FILES`` (named, with its extension).
    """
    if is_dataset_dir(source):
        return sorted(p for p in glob.glob(os.path.join(source, "**", "*"), recursive=True) if os.path.isfile(p))
    if os.path.isdir(source):
        paths = sorted(glob.glob(os.path.join(source, "**", "*.txt"), recursive=True))
    else:
        paths = sorted(glob.glob(source))
    if not paths:
        raise DataError(f"no text found at {source!r}; {SOURCES}")
    other = next((p for p in paths if not p.endswith(TEXT_FILES)), None)
    if other is not None:
        ext = os.path.splitext(other)[1]
        kind = f"a {ext!r} file" if ext else "a file without an extension"
        raise DataError(f"data file {other!r} is {kind}, which zinfjax does not read; {SOURCES}")
    return paths


def plain_text(path: str) -> bool:
    """Whether ``path`` is read as plain text (not JSON Lines or Parquet)."""
    return not path.endswith((".jsonl", ".parquet"))


def documents(source: str, field: str = "text") -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces of ``source``, in order (see the module docstring)."""
    if is_dataset_dir(source):
        yield from ((t, True) for t in _dataset_texts(source, field))
        return
    for path in source_paths(source):
        if path.endswith(".jsonl"):
            yield from ((t, True) for t in _jsonl_texts(path, field))
        elif path.endswith(".parquet"):
            yield from ((t, True) for t in _parquet_texts(path, field))
        else:
            yield from _text_pieces(path)


def encode_documents(tokenizer, texts: list[str]) -> list[int]:
    """The ids of whole documents ``texts``, each followed by the end-of-text token (if the tokenizer has one)."""
    return _encode(tokenizer, texts, [True] * len(texts))


def _text_pieces(path: str) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces of the text file ``path``; an empty file is no document and yields none."""
    rest, offset = b"", 0  # offset: where ``rest`` starts in the file
    with _open(path) as f:
        while True:
            block = f.read(PIECE)
            data = rest + block
            if not block:
                if data:
                    yield decode_text(data, path, offset), True
                return
            cut = _last_line_start(data)
            piece, rest = (data[:cut], data[cut:]) if cut > 0 else (b"", data)
            if piece:
                yield decode_text(piece, path, offset), False
                offset += len(piece)


def _last_line_start(data: bytes) -> int:
    """The offset after the last newline that a non-space character follows (0: none)."""
    i = len(data) - 1
    while True:
        i = data.rfind(b"\n", 0, i)
        if i < 0:
            return 0
        if i + 1 < len(data) and not data[i + 1 : i + 2].isspace():
            return i + 1


def decode_text(data: bytes, path: str, offset: int = 0) -> str:
    """``data``, the bytes of the text file ``path`` from byte ``offset`` on, as text.

    Raises:
        DataError: they are not UTF-8 (the first bad byte named by its place in the file).
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"text file {path!r} is not UTF-8 (byte {offset + e.start}): {e.reason}") from None


def _open(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"data file {path!r} cannot be read: {e.strerror or e}") from e


def _jsonl_texts(path: str, field: str) -> Iterator[str]:
    with _open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n} is not JSON: {e.msg}") from None
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{n} is not UTF-8: {e.reason}") from None
            yield _field(record, field, f"{path}:{n}")


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no field {field!r} (it has: {keys}); set data_field to the text's field")
    if not isinstance(record[field], str):
        raise DataError(f"{where}: field {field!r} is {type(record[field]).__name__}, not text")
    return record[field]


def _parquet_texts(path: str, field: str) -> Iterator[str]:
    pq = _need("pyarrow.parquet", "Parquet data")
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own errors for a file that is not Parquet
        raise DataError(f"{path!r} is not a Parquet file: {e}") from None
    names = table.schema_arrow.names
    if field not in names:
        raise DataError(f"{path} has no column {field!r} (it has: {', '.join(names)}); set data_field")
    for batch in table.iter_batches(columns=[field], batch_size=BATCH):
        yield from (_text(x, path, field) for x in batch.column(0).to_pylist())


def _dataset_texts(path: str, field: str) -> Iterator[str]:
    datasets = _need("datasets", "a datasets directory")
    data = datasets.load_from_disk(path)
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"the datasets directory {path} has no 'train' split (it has: {', '.join(data)})")
        data = data["train"]
    if field not in data.column_names:
        raise DataError(f"the dataset in {path} has no column {field!r} (it has: {', '.join(data.column_names)}); "
                        "set data_field")
    for batch in data.select_columns([field]).iter(batch_size=BATCH):
        yield from (_text(x, path, field) for x in batch[field])


def _text(x, path: str, field: str) -> str:
    if not isinstance(x, str):
        raise DataError(f"{path}: column {field!r} holds {type(x).__name__}, not text")
    return x


def _need(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs {module.split('.')[0]}: pip install 'zinfjax[data]'") from None


def data_digest(source: str) -> str:
    """A digest of what ``source`` names: each file's path relative to it, and its bytes."""
    h = hashlib.blake2b(digest_size=16)
    root = source if os.path.isdir(source) else os.path.dirname(source)
    for path in source_paths(source):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with _open(path) as f:
            for block in iter(lambda: f.read(8 << 20), b""):
                h.update(block)
    return h.hexdigest()


def no_text(source: str) -> DataError:
    """The error of a source that holds no text: empty files, or no documents."""
    return DataError(f"{source!r} holds no text to train on")


def token_dtype(vocab_size: int):
    """The narrowest unsigned type that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def cache_path(source: str, tokenizer, field: str) -> str:
    """Where the tokens of ``source`` by ``tokenizer`` are kept (see the module docstring)."""
    where = os.path.abspath(os.path.normpath(source))
    kind = np.dtype(token_dtype(tokenizer.vocab_size)).str[1:]  # u2 or u4
    base = os.path.basename(where).replace("*", "_")
    name = f"{base}-{data_digest(source)[:16]}-{tokenizer.digest[:16]}-{field}.{kind}"
    here = os.path.join(os.path.dirname(where), CACHE_DIR)  # beside the file, directory or glob: never inside it
    if _writable(here):
        return os.path.join(here, name)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "zinfjax", "tokens", name)


def _writable(directory: str) -> bool:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def tokenized(source: str, tokenizer, field: str = "text", progress: bool = False) -> np.memmap:
    """The tokens of ``source`` by ``tokenizer``, memory-mapped: from the cache, or tokenized into it first.

    Raises:
        DataError: a source that cannot be read, a record without ``field``, or no tokens at all.
    """
    path = cache_path(source, tokenizer, field)
    if not os.path.exists(path):
        _write_tokens(source, tokenizer, field, path, progress)
    return np.memmap(path, dtype=token_dtype(tokenizer.vocab_size), mode="r")


def _write_tokens(source: str, tokenizer, field: str, path: str, progress: bool) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    dtype, total, bar = token_dtype(tokenizer.vocab_size), 0, None
    fd, temp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tokens-")
    try:
        with os.fdopen(fd, "wb") as out:
            for ids in _token_batches(source, tokenizer, field):
                if ids and bar is None:  # shown from the first tokens on: a source without any says its error alone
                    bar = tqdm(desc=f"tokenizing {source}", unit=" tokens", disable=not progress, leave=False)
                out.write(np.asarray(ids, dtype=dtype).tobytes())
                total += len(ids)
                if bar is not None:
                    bar.update(len(ids))
        if total == 0:
            raise no_text(source)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    finally:
        if bar is not None:
            bar.close()


def _token_batches(source: str, tokenizer, field: str) -> Iterator[list[int]]:
    """Lists of ids, a batch of pieces at a time, with the end-of-text token after each document."""
    texts, ends = [], []
    for text, end in documents(source, field):
        texts.append(text)
        ends.append(end)
        if len(texts) == BATCH:
            yield _encode(tokenizer, texts, ends)
            texts, ends = [], []
    if texts:
        yield _encode(tokenizer, texts, ends)


def _encode(tokenizer, texts: list[str], ends: list[bool]) -> list[int]:
    out: list[int] = []
    for ids, end in zip(tokenizer.encode_batch(texts), ends, strict=True):
        out.extend(ids)
        if end and tokenizer.eos_id is not None:
            out.append(tokenizer.eos_id)
    return out
