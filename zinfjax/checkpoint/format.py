"""The checkpoint on disk: orbax PyTree items of zarr3 arrays, plus ``zinfjax.json``.

```
<save_dir>/<step>/
  params/        the parameters (fp32 master weights under mixed precision), an orbax PyTree
                 checkpoint: _METADATA, and one zarr3 array per leaf of your own tree, named by its
                 key path (``blocks.attn.q.kernel``); stacked blocks keep their layer axis
  opt_state/     the optax state of the whole tree, the same way (``0.mu.blocks.attn.q.kernel``,
                 ``0.count``)
  zinfjax.json   step, data position, seed, loss scale, the run's config and model, every leaf's
                 shape/dtype/chunk shape, and the bytes each store held on its tier
```

A chunk is one layer of one device shard, raw little-endian bytes followed by their crc32c: the
nvme tier's own chunk encoding (docs/store.md), so the chunk files of a working store on the same
filesystem become checkpoint files by a hard link. Any zarr3 reader checks the crc32c; plain
orbax restores ``params`` without zinfjax:

    >>> import numpy as np, orbax.checkpoint as ocp, tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> path = write_params(tempfile.mkdtemp(), {"blocks": {"w": np.ones((3, 4, 4), np.float32)}}, step=7)
    >>> w = ocp.PyTreeCheckpointer().restore(f"{path}/params")["blocks"]["w"]
    >>> type(w).__name__, w.shape
    ('ndarray', (3, 4, 4))
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from zinfjax.checkpoint.schema import check_meta, damaged
from zinfjax.store import manifest

ITEMS = ("params", "opt_state")
META = "zinfjax.json"
ORBAX_METADATA = "_METADATA"
FORMAT_VERSION = 2  # 2: leaves named by the user's tree paths; the optimizer state is one optax tree


def step_dir(save_dir: str, step: int) -> str:
    """The directory of checkpoint ``step`` (orbax's step naming: the bare number)."""
    return os.path.join(save_dir, str(int(step)))


def complete_steps(save_dir: str) -> list[int]:
    """The steps with a complete checkpoint in ``save_dir``, oldest first.

    A checkpoint appears under its number only once complete (it is written under a temporary
    name and renamed), so a directory named by a number that holds ``zinfjax.json`` is one.

    Example:
        >>> import numpy as np, tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> save_dir = tempfile.mkdtemp()
        >>> for step in (50, 100):
        ...     path = write_params(save_dir, {"w": np.ones(4, np.float32)}, step=step)
        >>> os.makedirs(f"{save_dir}/150")        # a step directory without its zinfjax.json
        >>> complete_steps(save_dir), step_names(save_dir)
        ([50, 100], [50, 100, 150])
    """
    return [s for s in step_names(save_dir) if os.path.isfile(os.path.join(step_dir(save_dir, s), META))]


def leaf_metadata(shape, dtype, chunk_shape) -> dict:
    return {"shape": [int(d) for d in shape], "dtype": np.dtype(dtype).name,
            "chunk_shape": [int(d) for d in chunk_shape]}


def zarr_metadata(meta: dict) -> dict:
    """The zarr3 ``zarr.json`` of a leaf: the nvme tier's codecs (raw bytes + crc32c)."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": meta["shape"],
        "data_type": meta["dtype"],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": meta["chunk_shape"]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "fill_value": 0 if np.dtype(meta["dtype"]).kind in "iub" else 0.0,
    }


def orbax_metadata(keys: dict[str, tuple]) -> dict:
    """Orbax's ``_METADATA`` for leaves ``{directory name: key path}``, restored as numpy arrays."""
    tree = {}
    for keypath in keys.values():
        key_meta = [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in keypath]
        tree[str(tuple(str(k) for k in keypath))] = {
            "key_metadata": key_meta, "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
    return {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def key_path(group: str, path) -> tuple:
    """A leaf's key path as plain keys (str, or int for a sequence index), under its group."""
    keys = [group]
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            keys.append(k.idx)
        elif isinstance(k, jax.tree_util.DictKey):
            keys.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            keys.append(k.name)
        else:
            keys.append(str(k))
    return tuple(keys)


def write_json(path: str, value) -> None:
    """Writes JSON durably: a temporary file, fsync, rename."""
    manifest.write_json(path, value)


def read_meta(directory: str) -> dict:
    """The ``zinfjax.json`` of the checkpoint ``directory``, checked against its schema.

    Raises:
        CheckpointCorruptError: the file is missing, unreadable, not JSON, or lacks a key or has a
            value of the wrong type (one line, naming the key).
    """
    path = os.path.join(directory, META)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError as e:
        raise damaged(path, "the file is missing") from e
    except OSError as e:
        raise damaged(path, f"it cannot be read ({e.strerror or e})") from e
    except ValueError as e:  # not JSON, or not UTF-8
        raise damaged(path, f"it is not JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from e
    return check_meta(meta, path)


def step_names(save_dir: str) -> list[int]:
    """Every step directory in ``save_dir``, complete or not (a checkpoint is complete once renamed to its step).

    Example:
        >>> import tempfile
        >>> save_dir = tempfile.mkdtemp()
        >>> for name in ("100", "50", ".tmp-150", "notes"):
        ...     os.makedirs(f"{save_dir}/{name}")
        >>> step_names(save_dir)
        [50, 100]
    """
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and n.isascii() and os.path.isdir(os.path.join(save_dir, n)))
