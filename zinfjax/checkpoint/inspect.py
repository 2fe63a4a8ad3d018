"""``zinfjax ckpt``: what a checkpoint holds, and its parameters exported for inference."""

from __future__ import annotations

import json
import os

import numpy as np
import tensorstore as ts

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointError, CheckpointSaveError
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.units import format_bytes

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def info_text(path: str, as_json: bool = False) -> str:
    """The steps of a save_dir, then the newest checkpoint's leaves, bytes per tier and config.

    Example:
        >>> print(info_text("runs/demo/ckpt"))
    """
    newest = latest_checkpoint(path)
    meta = fmt.read_meta(newest)
    if as_json:
        return json.dumps(meta, indent=1)
    root = os.path.dirname(newest)
    lines = [f"checkpoint directory: {root}", f"steps: {', '.join(map(str, fmt.complete_steps(root)))}",
             f"newest: {newest} (step {meta['step']}, data position {meta['data_position']}, saved "
             f"{meta['created']} by {meta['processes']} process(es) on {meta['devices']} device(s))",
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
    return "\n".join(lines)


def export_params(path: str, out: str, dtype: str | None = None) -> dict:
    """Writes the parameters alone, cast to ``dtype`` (default: the run's precision), as an orbax checkpoint.

    One layer at a time, so memory stays at one layer whatever the model's size.

    Example:
        >>> export_params("runs/demo/ckpt", "runs/demo/params-bf16", "bf16")
        >>> ocp.PyTreeCheckpointer().restore("runs/demo/params-bf16")
    """
    src = latest_checkpoint(path)
    meta = fmt.read_meta(src)
    name = DTYPES[dtype or meta["precision"]]
    if os.path.exists(out) and os.listdir(out):
        raise CheckpointSaveError(f"{out} exists and is not empty; choose a new directory for the export")
    leaves, keys, total = meta["items"]["params"], _orbax_keys(src), 0
    try:
        for leaf, m in leaves.items():
            total += _copy_leaf(os.path.join(src, "params", leaf), os.path.join(out, leaf), m, name,
                                stacked=leaf.startswith("blocks."))
    except ValueError as e:
        raise CheckpointError(f"cannot export {src}: {e}") from e
    fmt.write_json(os.path.join(out, fmt.ORBAX_METADATA), fmt.orbax_metadata(keys))
    return {"source": src, "dtype": name, "leaves": len(leaves), "bytes": total}


def _copy_leaf(src: str, dst: str, meta: dict, dtype: str, stacked: bool) -> int:
    source = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": src}}, open=True).result()
    target = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": dst},
                      "metadata": fmt.zarr_metadata({**meta, "dtype": dtype})}, create=True).result()
    for sl in (range(meta["shape"][0]) if stacked else [Ellipsis]):
        target[sl].write(source[sl].read().result().astype(target.dtype.numpy_dtype)).result()
    return int(np.prod(meta["shape"], dtype=np.int64)) * target.dtype.numpy_dtype.itemsize


def _orbax_keys(src: str) -> dict[str, tuple]:
    with open(os.path.join(src, "params", fmt.ORBAX_METADATA)) as f:
        tree = json.load(f)["tree_metadata"]
    return {".".join(str(k["key"]) for k in v["key_metadata"]): tuple(
        k["key"] if k["key_type"] == 2 else int(k["key"]) for k in v["key_metadata"]) for v in tree.values()}


def _nbytes(meta: dict) -> int:
    return int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
