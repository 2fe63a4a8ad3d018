"""A frozen base: the checkpoint a fine-tune reads its frozen parameters from, named by path and digest.

A run that trains adapters (LoRA) on a converted or pretrained model never changes the base, so its
checkpoints hold the trainable leaves alone plus a reference to the base: ``"base": {"path", "digest"}``
in ``zinfjax.json``. The digest (`digest`) is a blake2b of the base's parameter leaves (names, shapes,
dtypes) and every chunk file's size and crc32c, the four bytes that end each chunk: it reads a few bytes
per chunk, not the weights, and changes whenever any weight does. A resume, an evaluation or an export
from such a checkpoint checks it (`check_base`) and refuses a base that changed since.

Example:
    >>> import numpy as np, tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> base = write_params(tempfile.mkdtemp(), {"blocks": {"w": np.ones((3, 4, 4), np.float32)}})
    >>> ref = base_ref(base)
    >>> ref["digest"]
    'b2:...'
    >>> check_base(ref, "runs/lora/20") == base  # the base as it was: its directory
    True
    >>> other = write_params(tempfile.mkdtemp(), {"blocks": {"w": np.zeros((3, 4, 4), np.float32)}})
    >>> digest(other) == ref["digest"]           # other weights, another digest
    False
    >>> import shutil; shutil.rmtree(base)
    >>> check_base(ref, "runs/lora/20")
    Traceback (most recent call last):
    zinfjax.checkpoint.base.BaseChangedError: runs/lora/20 was trained on the base ..., which is gone; ...
"""

from __future__ import annotations

import hashlib
import os

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointError
from zinfjax.checkpoint.manager import latest_checkpoint

PREFIX = "b2:"


class BaseChangedError(CheckpointError):
    """The base a fine-tune's checkpoint names is missing, or its weights changed since."""


def digest(directory: str) -> str:
    """The digest of the parameters of checkpoint ``directory`` (see the module docstring).

    Raises:
        CheckpointError: a chunk file cannot be read.
    """
    meta = fmt.read_meta(directory)
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(meta["items"]["params"]):
        leaf = meta["items"]["params"][name]
        h.update(f"{name}:{leaf['dtype']}{leaf['shape']}\n".encode())
        leaf_dir = os.path.join(directory, "params", name)
        for rel in _chunk_files(leaf_dir):
            h.update(f"{rel}:".encode() + _tail(os.path.join(leaf_dir, rel)))
    return PREFIX + h.hexdigest()


def base_ref(path: str) -> dict:
    """``{"path", "digest"}`` of the checkpoint ``path`` names (a checkpoint, or a save_dir: its newest)."""
    directory = latest_checkpoint(path)
    return {"path": directory, "digest": digest(directory)}


def check_base(ref: dict, owner: str) -> str:
    """The base directory ``ref`` names, once its digest is checked; ``owner`` is the checkpoint that names it.

    Raises:
        BaseChangedError: the base is gone, or its digest differs (both digests named).
    """
    path = ref["path"]
    if not os.path.isfile(os.path.join(path, fmt.META)):
        raise BaseChangedError(f"{owner} was trained on the base {path}, which is gone; restore that checkpoint there "
                               "(its digest was " + ref["digest"] + ")")
    now = digest(path)
    if now != ref["digest"]:
        raise BaseChangedError(f"the base {path} changed since {owner} was trained on it: its digest was "
                               f"{ref['digest']}, now {now}; train the adapter anew on this base, or restore the base "
                               "it was trained on")
    return path


def _chunk_files(leaf_dir: str) -> list[str]:
    """Every chunk file of a leaf, relative to it, in a fixed order."""
    out = []
    for here, dirs, files in os.walk(os.path.join(leaf_dir, "c")):
        dirs.sort()
        out += [os.path.relpath(os.path.join(here, f), leaf_dir) for f in sorted(files)]
    return out


def _tail(path: str) -> bytes:
    """A chunk's size and crc32c (its last four bytes)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(size - 4, 0))
            crc = f.read(4)
    except OSError as e:
        raise CheckpointError(f"cannot read the chunk {path}: {e.strerror or e}") from e
    return f"{size}:".encode() + crc
