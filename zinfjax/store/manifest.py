"""The nvme store's manifest: what is on disk, so a reopen can check it and a restore can read it.

`manifest.json` holds the format version, the number of layers, and per leaf its name, shape,
dtype, chunk shape, the per-layer PartitionSpec and the mesh it was written from. It is written
atomically (temporary file, fsync, rename, fsync of the directory).
"""

from __future__ import annotations

import json
import os
import shutil

from zinfjax.store.errors import ManifestMismatchError, StoreError
from zinfjax.store.layout import LeafLayout, mesh_description, spec_description

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CODECS = ["bytes", "crc32c"]


def build(name: str, layouts: list[LeafLayout]) -> dict:
    """The manifest of a store called `name` holding `layouts`."""
    num_layers = layouts[0].num_layers if layouts else 0
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "num_layers": num_layers,
        "layout": "one zarr3 array per leaf; one chunk per (layer, device shard); codecs bytes+crc32c",
        "leaves": [_leaf_entry(lay) for lay in layouts],
    }


def _leaf_entry(lay: LeafLayout) -> dict:
    return {
        "name": lay.name,
        "path": lay.name,
        "shape": [lay.num_layers, *lay.layer_shape],
        "dtype": lay.dtype.name,
        "chunk_shape": [1, *lay.shard_shape],
        "layer_spec": spec_description(lay.sharding),
        "mesh": mesh_description(lay.sharding),
        "codecs": CODECS,
    }


def write(directory: str, manifest: dict) -> None:
    """Writes `manifest` into `directory` atomically."""
    write_json(os.path.join(directory, MANIFEST), manifest)


def write_json(path: str, value) -> None:
    """Writes `value` as JSON atomically and durably: a temporary file, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(directory: str) -> None:
    """Makes a rename or creation inside `directory` durable (works on a file's path too: its data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # fsync names no file: the error does (EIO, say), for the one line the user sees
        raise OSError(e.errno, e.strerror, directory) from e
    finally:
        os.close(fd)


def read(directory: str) -> dict | None:
    """The manifest in `directory`, or None when there is none."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise StoreError(f"cannot read the store manifest {path}: {e}") from e


def check(directory: str, found: dict, expected: dict) -> None:
    """Raises `ManifestMismatchError` naming the first difference between the two manifests."""
    fix = f"open it with the shapes it was written with, or use a fresh nvme_path, or delete {directory}"
    if found.get("format_version") != FORMAT_VERSION:
        raise ManifestMismatchError(
            f"store {directory} has format version {found.get('format_version')}, this zinfjax reads "
            f"{FORMAT_VERSION}; {fix}"
        )
    if found.get("num_layers") != expected["num_layers"]:
        raise ManifestMismatchError(
            f"store {directory} holds {found.get('num_layers')} layers, "
            f"expected {expected['num_layers']}; {fix}"
        )
    have = {leaf["name"]: leaf for leaf in found.get("leaves", [])}
    want = {leaf["name"]: leaf for leaf in expected["leaves"]}
    if set(have) != set(want):
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        raise ManifestMismatchError(
            f"store {directory} holds other leaves: missing {missing}, unexpected {extra}; {fix}"
        )
    for name, leaf in want.items():
        for key in ("shape", "dtype", "chunk_shape", "layer_spec", "mesh"):
            if have[name].get(key) != leaf[key]:
                raise ManifestMismatchError(
                    f"store {directory}: leaf {name!r} has {key} {have[name].get(key)} on disk but "
                    f"{leaf[key]} was asked for; {fix}"
                )


def matches(directory: str, found: dict, expected: dict) -> bool:
    """Whether ``found`` is the manifest ``expected`` (`check` raises nothing)."""
    try:
        check(directory, found, expected)
    except ManifestMismatchError:
        return False
    return True


def clear(directory: str, keep: str) -> None:
    """Deletes what a store left in ``directory`` (its leaves and manifest), all but the file ``keep`` (its lock)."""
    for entry in os.scandir(directory):
        if entry.path == keep:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.remove(entry.path)
