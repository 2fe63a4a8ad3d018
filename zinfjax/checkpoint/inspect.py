"""``zinfjax ckpt``: what a checkpoint holds, and its parameters exported for inference."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import tensorstore as ts

from zinfjax._util.byte_sizes import format_bytes
from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.checkpoint.verify import verify_checkpoint, verify_save_dir

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def info_text(path: str, as_json: bool = False) -> str:
    """The steps of a save_dir, then the newest checkpoint's leaves, bytes per tier and config.

    Example:
        >>> import numpy as np, tempfile
        >>> from zinfjax import Config
        >>> from zinfjax.checkpoint.writer import write_params
        >>> save_dir = tempfile.mkdtemp()
        >>> for step in (50, 100):
        ...     path = write_params(save_dir, {"blocks": {"w": np.ones((3, 4, 4), np.float32)}}, step=step,
        ...                         config=Config(lr=1e-3))
        >>> print(info_text(save_dir))
        checkpoint directory: ...
        steps: 50, 100
        newest: .../100 (step 100, data position 0, saved ... by 1 process(es) on 0 device(s))
        bytes per tier when saved: converted 192 B (params, opt_state)
        params: 1 leaves, 192 B
          blocks.w                                 float32   (3, 4, 4)
        opt_state: 0 leaves, 0 B
        config: stage=0, params=device, ..., lr=0.001, ...
    """
    newest = latest_checkpoint(path)
    meta = fmt.read_meta(newest)
    if as_json:
        return json.dumps(meta, indent=1)
    root = os.path.dirname(newest)
    run = f", run {meta['run_id']}" if meta.get("run_id") else ""
    lines = [f"checkpoint directory: {root}", f"steps: {', '.join(map(str, fmt.complete_steps(root)))}",
             f"newest: {newest} (step {meta['step']}, data position {meta['data_position']}, saved "
             f"{meta['created']} by {meta['processes']} process(es) on {meta['devices']} device(s){run})",
             "bytes per tier when saved: " + ", ".join(f"{tier} {format_bytes(t['bytes'])} ({', '.join(t['stores'])})"
                                                     for tier, t in meta["tiers"].items())]
    for item, leaves in meta["items"].items():
        total = sum(_nbytes(m) for m in leaves.values())
        lines.append(f"{item}: {len(leaves)} leaves, {format_bytes(total)}")
        lines += [f"  {name:<40} {m['dtype']:<9} {tuple(m['shape'])}" for name, m in leaves.items()]
    config = meta.get("config") or {}
    lines.append("config: " + ", ".join(f"{k}={v}" for k, v in config.items()))
    if meta.get("model"):
        lines.append("model: " + ", ".join(f"{k}={v}" for k, v in meta["model"].items()))
    aside = set_aside_dirs(root)
    if aside:
        lines.append(f"set aside (not resumed from; delete when no longer needed): {', '.join(aside)}")
    return "\n".join(lines)


def verify_text(path: str) -> tuple[str, bool]:
    """Every checkpoint of a save_dir (or the one ``path`` names) checked, one line each; and whether all are complete.

    Example:
        >>> import numpy as np, tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> save_dir = tempfile.mkdtemp()
        >>> for step in (4, 6):
        ...     path = write_params(save_dir, {"blocks": {"fc": {"kernel": np.ones((3, 4, 4), np.float32)}}}, step=step)
        >>> with open(f"{path}/params/blocks.fc.kernel/c/2/0/0", "r+b") as chunk:   # a bit flips in step 6's layer 2
        ...     _ = chunk.write(bytes([1]))
        >>> print(verify_text(save_dir)[0])
        step 4: complete
        step 6: corrupt (params/blocks.fc.kernel: chunk c/2/0/0: crc32c mismatch)
        1 of 2 complete; the newest complete is step 4
    """
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, fmt.META)) or not os.path.isdir(path):
        found = [verify_checkpoint(path)] if os.path.isdir(path) else []
    else:
        found = verify_save_dir(path)
    if not found:
        raise CheckpointNotFoundError(f"no checkpoint in {path}: give a save_dir or one checkpoint (<save_dir>/<step>)")
    complete = [c.step for c in found if c.complete]
    summary = (f"{len(complete)} of {len(found)} complete" + (f"; the newest complete is step {complete[-1]}"
                                                             if complete else ""))
    return "\n".join([*(c.describe() for c in found), summary]), len(complete) == len(found)


def set_aside_dirs(save_dir: str) -> list[str]:
    """The ``.replaced-*`` and ``.superseded-*`` directories of checkpoints moved out of the step namespace."""
    try:
        return sorted(n for n in os.listdir(save_dir) if n.startswith((".replaced-", ".superseded-")))
    except OSError:
        return []


def export_params(path: str, out: str, dtype: str | None = None) -> dict:
    """Writes the parameters alone, cast to ``dtype`` (default: the run's precision), as an orbax checkpoint.

    One layer at a time, so memory stays at one layer whatever the model's size.

    Example:
        >>> import numpy as np, orbax.checkpoint as ocp, tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> path = write_params(tempfile.mkdtemp(), {"blocks": {"w": np.ones((3, 4, 4), np.float32)}})
        >>> out = f"{tempfile.mkdtemp()}/params-bf16"
        >>> export_params(path, out, "bf16")
        {'source': '...', 'dtype': 'bfloat16', 'leaves': 1, 'bytes': 96}
        >>> ocp.PyTreeCheckpointer().restore(out)["blocks"]["w"].dtype
        dtype(bfloat16)
    """
    src = latest_checkpoint(path)
    meta = fmt.read_meta(src)
    name = DTYPES.get(dtype or meta["precision"])
    if name is None:
        raise CheckpointError(f"{src} records precision {meta['precision']!r}; give --dtype fp32, bf16 or fp16")
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out)):
        raise CheckpointSaveError(f"{out} exists and is not empty; choose a new directory for the export")
    leaves, keys, total = meta["items"]["params"], _orbax_keys(src), 0
    # Written beside `out` under a hidden name and renamed at the end: a failure (or a crash) leaves no
    # partial export under `out` for a rerun to refuse.
    parent, base = os.path.split(os.path.abspath(out))
    partial = os.path.join(parent, f".{base}.partial-{os.getpid()}")
    try:
        os.makedirs(partial)
        for leaf, m in leaves.items():
            total += _copy_leaf(os.path.join(src, "params", leaf), os.path.join(partial, leaf), m, name)
        fmt.write_json(os.path.join(partial, fmt.ORBAX_METADATA), fmt.orbax_metadata(keys))
        os.rename(partial, out)  # onto a missing or empty directory
    except (ValueError, OSError) as e:  # tensorstore reports I/O errors as ValueError
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"cannot export {src} to {out}: {_first_line(e)}; nothing was left there") from e
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {"source": src, "dtype": name, "leaves": len(leaves), "bytes": total}


def _first_line(e: Exception) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return text.splitlines()[0][:300]


def _copy_leaf(src: str, dst: str, meta: dict, dtype: str) -> int:
    """Copies one leaf cast to ``dtype``, a chunk's rows at a time (a layer, a row chunk), so memory stays at one."""
    source = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": src}}, open=True).result()
    found = fmt.leaf_metadata(source.shape, source.dtype.numpy_dtype, source.chunk_layout.read_chunk.shape)
    said = {k: meta.get(k) for k in found}
    if found != said:  # zinfjax.json and the array disagree: trust neither with sizes
        raise CheckpointCorruptError(f"{src}/zarr.json holds {found}, {fmt.META} says {said}; the checkpoint is "
                                     "damaged: restore it or use another")
    target = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": dst},
                      "metadata": fmt.zarr_metadata({**meta, "dtype": dtype})}, create=True).result()
    shape, rows = meta["shape"], (meta["chunk_shape"] or [1])[0]
    for sl in ([slice(r, r + rows) for r in range(0, shape[0], rows)] if shape else [Ellipsis]):
        target[sl].write(source[sl].read().result().astype(target.dtype.numpy_dtype)).result()
    return int(np.prod(meta["shape"], dtype=np.int64)) * target.dtype.numpy_dtype.itemsize


def _orbax_keys(src: str) -> dict[str, tuple]:
    path = os.path.join(src, "params", fmt.ORBAX_METADATA)
    try:
        with open(path) as f:
            tree = json.load(f)["tree_metadata"]
        return {".".join(str(k["key"]) for k in v["key_metadata"]): tuple(
            k["key"] if k["key_type"] == 2 else int(k["key"]) for k in v["key_metadata"]) for v in tree.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # missing, not JSON, or not orbax's
        raise CheckpointCorruptError(f"{path} is damaged ({_first_line(e)}); `zinfjax ckpt info "
                                     f"{os.path.dirname(src)} --verify` checks every checkpoint") from e


def _nbytes(meta: dict) -> int:
    return math.prod(meta["shape"]) * np.dtype(meta["dtype"]).itemsize
