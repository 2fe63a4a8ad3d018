"""The schema of ``zinfjax.json``: a damaged or hand-edited file is refused in one line, before it is used.

Every reader (``ckpt info``, resuming, inference, conversion) gets its metadata through
`zinfjax.checkpoint.format.read_meta`, which checks it here, so none of them meets a missing key or
a value of the wrong type later, deep inside a restore.

Example:
    >>> import numpy as np, tempfile
    >>> from zinfjax.checkpoint import format as fmt
    >>> from zinfjax.checkpoint.writer import write_params
    >>> path = write_params(tempfile.mkdtemp(), {"w": np.ones(4, np.float32)}, step=3)
    >>> meta = fmt.read_meta(path)                     # checked here on its way in
    >>> check_meta({**meta, "step": -1}, "runs/ckpt/3/zinfjax.json")
    Traceback (most recent call last):
    zinfjax.checkpoint.errors.CheckpointCorruptError: runs/ckpt/3/zinfjax.json is damaged: at step: -1 is less than ...
"""

from __future__ import annotations

import jsonschema
import numpy as np

from zinfjax.checkpoint.errors import CheckpointCorruptError

_COUNT = {"type": "integer", "minimum": 0}
_DIM = 2**40  # far beyond any real dimension, and small enough that sizes stay exact
_LEAF = {
    "type": "object",
    "required": ["shape", "dtype", "chunk_shape"],
    "properties": {
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": _DIM}, "maxItems": 32},
        "dtype": {"type": "string"},
        "chunk_shape": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": _DIM}},
    },
}
_TIER = {
    "type": "object",
    "required": ["bytes", "stores"],
    "properties": {"bytes": _COUNT, "stores": {"type": "array", "items": {"type": "string"}}},
}
META_SCHEMA = {
    "type": "object",
    "required": ["format_version", "step", "data_position", "seed", "loss_scale", "precision", "num_layers",
                 "processes", "devices", "created", "config", "model", "tiers", "items"],
    "properties": {
        "format_version": {"type": "integer", "minimum": 1},
        "step": _COUNT,
        "data_position": _COUNT,
        "seed": {"type": "integer"},
        "loss_scale": {"type": "number", "exclusiveMinimum": 0},
        "loss_scale_good": _COUNT,
        "precision": {"type": "string"},
        "num_layers": _COUNT,
        "processes": {"type": "integer", "minimum": 1},
        "devices": _COUNT,
        "created": {"type": "string"},
        "config": {"type": "object"},
        "model": {"type": ["object", "null"]},
        "run_id": {"type": "string", "minLength": 1},
        "base": {"type": "object", "required": ["path", "digest"],
                 "properties": {"path": {"type": "string", "minLength": 1}, "digest": {"type": "string"}}},
        "tiers": {"type": "object", "additionalProperties": _TIER},
        "items": {
            "type": "object",
            "required": ["params", "opt_state"],
            "properties": {"params": {"type": "object", "additionalProperties": _LEAF},
                           "opt_state": {"type": "object", "additionalProperties": _LEAF}},
            "additionalProperties": False,
        },
    },
}

# JSON Schema counts 4.0 as an integer; the readers index arrays with these numbers, so only ints are.
_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_TYPES)
_VALIDATOR = _Validator(META_SCHEMA)


def check_meta(meta, path: str) -> dict:
    """Returns ``meta`` (the parsed ``zinfjax.json`` at ``path``) if it is whole, else raises.

    Raises:
        CheckpointCorruptError: naming the first key at fault.
    """
    error = jsonschema.exceptions.best_match(_VALIDATOR.iter_errors(meta))
    if error is not None:
        where = ".".join(str(k) for k in error.absolute_path) or "the top level"
        raise damaged(path, f"at {where}: {error.message}")
    for item, leaves in meta["items"].items():
        for name, leaf in leaves.items():
            problem = _leaf_problem(leaf)
            if problem:
                raise damaged(path, f"at items.{item}.{name}: {problem}")
    return meta


def _leaf_problem(leaf: dict) -> str | None:
    if len(leaf["chunk_shape"]) != len(leaf["shape"]):
        return f"chunk_shape {leaf['chunk_shape']} has another rank than shape {leaf['shape']}"
    try:
        np.dtype(leaf["dtype"])
    except (TypeError, ValueError, OverflowError):
        return f"dtype {leaf['dtype']!r} is no dtype"
    return None


def damaged(path: str, problem: str) -> CheckpointCorruptError:
    """The error for a ``zinfjax.json`` that cannot be used, with what to do about it (``.detail``: without that)."""
    detail = f"{path} is damaged: {_one_line(problem)}"
    error = CheckpointCorruptError(f"{detail}; `zinfjax ckpt info <save_dir> --verify` lists the complete "
                                   "checkpoints, and resume=STEP continues from one of them")
    error.detail = detail
    return error


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]
