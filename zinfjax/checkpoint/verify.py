"""Which checkpoints of a save_dir are complete, corrupt or partial: every chunk's crc32c checked.

A checkpoint is **complete** when its ``zinfjax.json`` passes its schema and every chunk of every
leaf it lists is there, of the right size, with a matching crc32c. It is **corrupt** when a file
is there but wrong (bad JSON, a checksum mismatch, a chunk of the wrong size), and **partial**
when files are missing (a checkpoint half deleted by an older zinfjax, or copied in part). A save
or a deletion cut short by a crash leaves a ``.tmp-<step>`` or ``.deleting-<step>`` directory
outside the step namespace: partial too, and removed when the next run starts.

Example:
    >>> import numpy as np, tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> save_dir = tempfile.mkdtemp()
    >>> for step in (4, 6):
    ...     path = write_params(save_dir, {"blocks": {"fc": {"kernel": np.ones((3, 4, 4), np.float32)}}}, step=step)
    >>> with open(f"{path}/params/blocks.fc.kernel/c/2/0/0", "r+b") as chunk:   # a bit flips in step 6's layer 2
    ...     _ = chunk.write(bytes([1]))
    >>> os.remove(f"{save_dir}/4/params/blocks.fc.kernel/c/0/0/0")               # and step 4 loses a chunk
    >>> [c.describe() for c in verify_save_dir(save_dir)]
    ['step 4: partial (params/blocks.fc.kernel: chunk c/0/0/0 is missing)',
     'step 6: corrupt (params/blocks.fc.kernel: chunk c/2/0/0: crc32c mismatch)']
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointCorruptError
from zinfjax.store import chunkfile
from zinfjax.store.nvme import aligned_empty

COMPLETE, CORRUPT, PARTIAL = "complete", "corrupt", "partial"
TMP, DELETING = ".tmp-", ".deleting-"  # a save, and a deletion, in progress (or cut short)


@dataclasses.dataclass(frozen=True)
class Checked:
    """What `verify_checkpoint` found in one entry of a save_dir."""

    name: str  # the entry: "6", or ".tmp-8" for a save cut short
    step: int | None
    state: str  # COMPLETE, CORRUPT or PARTIAL
    reason: str = ""

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE

    def describe(self) -> str:
        what = f"step {self.step}" if self.name.isdigit() else self.name
        return f"{what}: {self.state}" + (f" ({self.reason})" if self.reason else "")


def verify_checkpoint(directory: str, checksums: bool = True) -> Checked:
    """Checks one checkpoint: its metadata, and every chunk's presence, size and (with ``checksums``) crc32c."""
    name = os.path.basename(os.path.normpath(directory))
    step = int(name) if name.isascii() and name.isdigit() else None
    found = _problem(directory, step, checksums)
    return Checked(name, step, COMPLETE) if found is None else Checked(name, step, *found)


def verify_save_dir(save_dir: str, checksums: bool = True) -> list[Checked]:
    """Every checkpoint in ``save_dir``, oldest first, then the saves and deletions that were cut short."""
    out = [verify_checkpoint(fmt.step_dir(save_dir, s), checksums) for s in fmt.step_names(save_dir)]
    for name in sorted(leftovers(save_dir)):
        why = ("a save cut short; removed when the next run starts" if name.startswith(TMP)
               else "a deletion cut short; removed when the next run starts")
        out.append(Checked(name, None, PARTIAL, why))
    return out


def leftovers(save_dir: str) -> list[str]:
    """The ``.tmp-*`` and ``.deleting-*`` directories that a crash left in ``save_dir``."""
    try:
        return [n for n in os.listdir(save_dir) if n.startswith((TMP, DELETING))]
    except OSError:
        return []


def _problem(directory: str, step: int | None, checksums: bool) -> tuple[str, str] | None:
    """``(state, reason)`` of the first thing wrong with the checkpoint, or None."""
    if not os.path.isfile(os.path.join(directory, fmt.META)):
        return PARTIAL, f"no {fmt.META}: never finished, or half deleted"
    try:
        meta = fmt.read_meta(directory)
    except CheckpointCorruptError as e:
        return CORRUPT, getattr(e, "detail", str(e))
    if step is not None and meta["step"] != step:
        return CORRUPT, f"{fmt.META} records step {meta['step']}"
    slots: dict[int, np.ndarray] = {}
    for item in fmt.ITEMS:
        if not os.path.isfile(os.path.join(directory, item, fmt.ORBAX_METADATA)):
            return PARTIAL, f"{item}/{fmt.ORBAX_METADATA} is missing"
        for leaf, m in meta["items"][item].items():
            found = _leaf_problem(os.path.join(directory, item, leaf), m, slots, checksums)
            if found is not None:
                return found[0], f"{item}/{leaf}: {found[1]}"
    return None


_SIZES = ("shape", "data_type", "chunk_grid")


def _array_metadata(leaf_dir: str) -> dict | None:
    """A leaf's ``zarr.json``, parsed; None when it is missing, ``{}`` when it is not a JSON object."""
    try:
        with open(os.path.join(leaf_dir, "zarr.json")) as f:
            found = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _leaf_problem(leaf_dir: str, meta: dict, slots: dict, checksums: bool) -> tuple[str, str] | None:
    array = _array_metadata(leaf_dir)
    if array is None:
        return PARTIAL, "zarr.json is missing"
    expected = fmt.zarr_metadata(meta)
    if any(array.get(k) != expected[k] for k in _SIZES):  # before any loop or buffer is sized from either
        return CORRUPT, f"zarr.json and {fmt.META} disagree on the shape, dtype or chunks"
    nbytes = math.prod(meta["chunk_shape"]) * np.dtype(meta["dtype"]).itemsize
    grid = [-(-n // c) for n, c in zip(meta["shape"], meta["chunk_shape"], strict=True)]
    for index in np.ndindex(*grid):  # lazily: itertools.product would first build every range whole
        path = chunkfile.chunk_path(leaf_dir, index)
        where = "c/" + "/".join(map(str, index)) if index else "c"
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return PARTIAL, f"chunk {where} is missing"
        except OSError as e:
            return CORRUPT, f"chunk {where} cannot be read ({e.strerror})"
        if size != nbytes + chunkfile.CHECKSUM_BYTES:  # before any buffer is sized from the metadata
            return CORRUPT, f"chunk {where} holds {size} bytes, not {nbytes + chunkfile.CHECKSUM_BYTES}"
        if checksums:
            if nbytes not in slots:
                slots.clear()  # one buffer at a time: a leaf's chunks share a size
                slots[nbytes] = aligned_empty((chunkfile.slot_bytes(nbytes),), np.uint8, chunkfile.BLOCK)
            try:
                chunkfile.read_chunk(path, slots[nbytes], nbytes)
            except chunkfile.ChunkCorruptError:
                return CORRUPT, f"chunk {where}: crc32c mismatch"
            except OSError as e:
                return CORRUPT, f"chunk {where} cannot be read ({e.strerror})"
    return None
