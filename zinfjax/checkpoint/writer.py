"""Writing a checkpoint from host arrays, one layer of one leaf at a time: what converters need.

A converter (a Hugging Face or DeepSpeed checkpoint, a torch ``state_dict``) holds one tensor at a
time. `CheckpointWriter` takes each as it comes and writes its chunks at once, so memory stays at
one tensor whatever the model's size; `commit` checks that every chunk was written, then makes the
checkpoint visible as `CheckpointManager` does (metadata, syncfs, one rename).

Example (a tensor at a time, as a converter reads them; `write_params` writes a tree held whole):
    >>> import jax, numpy as np, optax, tempfile
    >>> like = {"blocks": {"w": jax.ShapeDtypeStruct((3, 4, 4), np.float32)}}     # 3 layers of (4, 4)
    >>> leaves = expected_leaves(like, optax.sgd(0.1))                              # sgd: no optimizer state
    >>> save_dir = tempfile.mkdtemp()
    >>> with CheckpointWriter(save_dir, step=0, leaves=leaves) as w:
    ...     for layer in range(3):
    ...         w.write("params", "blocks.w", layer, np.full((4, 4), layer, np.float32))
    >>> sorted(os.listdir(save_dir))                                                  # committed as the block ends
    ['0']
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointError
from zinfjax.checkpoint.manager import _commit, _syncfs, _write_metadata
from zinfjax.checkpoint.snapshot import Leaf, leaf_name
from zinfjax.models.layered import stacked_blocks
from zinfjax.program.optimizer import owner_of
from zinfjax.program.split import plain_keys
from zinfjax.sharding import path_str
from zinfjax.store import chunkfile
from zinfjax.store.nvme import aligned_empty


def expected_leaves(abstract_params, tx, stacked=stacked_blocks) -> dict[str, dict[str, Leaf]]:
    """Every leaf a checkpoint of these parameters and this optax transformation holds.

    Parameters are fp32 (the master weights); the optimizer state is ``tx.init`` of the whole tree.
    A leaf whose path ``stacked`` accepts (and each state leaf of such a leaf, with its layer axis)
    is written one layer at a time; every other leaf whole.

    Example:
        >>> import jax, numpy as np, optax
        >>> abstract = {"blocks": {"fc": {"kernel": jax.ShapeDtypeStruct((4, 64, 256), np.float32)}}}
        >>> leaves = expected_leaves(abstract, optax.adamw(1e-3))
        >>> mu = leaves["opt_state"]["0.mu.blocks.fc.kernel"]           # Adam's first moment of the kernel
        >>> mu.meta["shape"], mu.stacked
        ([4, 64, 256], True)
    """
    f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.float32), abstract_params)
    params = [(path_str(p), plain_keys(p), x) for p, x in jax.tree_util.tree_flatten_with_path(f32)[0]]
    layers = {path: x.shape[0] for path, _, x in params if stacked(path)}
    state = jax.eval_shape(tx.init, f32)
    out: dict[str, dict[str, Leaf]] = {"params": {}, "opt_state": {}}
    for path, keys, x in params:
        out["params"][leaf_name(path)] = _leaf("params", path, keys, x, path in layers)
    all_paths = [path for path, _, _ in params]
    for p, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        path = path_str(p)
        owner = owner_of(path, all_paths)
        by_layer = owner in layers and np.ndim(x) >= 1 and np.shape(x)[0] == layers[owner]
        out["opt_state"][leaf_name(path)] = _leaf("opt_state", path, plain_keys(p), x, by_layer)
    return out


def _leaf(item: str, path: str, keys: tuple, x, by_layer: bool) -> Leaf:
    chunk = (1, *x.shape[1:]) if by_layer else x.shape
    return Leaf(item, leaf_name(path), keys, fmt.leaf_metadata(x.shape, x.dtype, chunk), by_layer)


class CheckpointWriter:
    """A checkpoint at ``<save_dir>/<step>`` written leaf by leaf, visible only after `commit`.

    ``config`` (a `Config`) and ``model`` (a `ModelConfig`) are recorded for ``zinfjax ckpt info``
    and for resuming; ``data_position`` is where a resumed run takes its next batch. ``base``
    (`zinfjax.checkpoint.base.base_ref`) names the frozen base of a checkpoint that holds adapters alone.
    """

    def __init__(self, save_dir: str, step: int, leaves: dict[str, dict[str, Leaf]], config=None, model=None,
                 data_position: int = 0, base: dict | None = None):
        self.save_dir, self.step, self.leaves = os.path.abspath(save_dir), int(step), leaves
        self.config, self.model, self.data_position, self.base = config, model, data_position, base
        self.tmp = os.path.join(self.save_dir, f".tmp-{self.step}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        self._written: set[tuple[str, str, int | None]] = set()
        self.bytes_written = 0

    def write(self, item: str, name: str, layer: int | None, array) -> None:
        """Writes one layer of a stacked leaf (``leaf.stacked``), or a whole leaf (``layer=None``)."""
        leaf = self._leaf(item, name)
        if (layer is not None) != leaf.stacked:
            how = "stacked: write it layer by layer" if leaf.stacked else "not stacked: write it whole (layer=None)"
            raise CheckpointError(f"{item}/{name} is {how}")
        array = np.asarray(array)
        want = leaf.meta["shape"][1:] if layer is not None else leaf.meta["shape"]
        if list(array.shape) != want or array.dtype != np.dtype(leaf.meta["dtype"]):
            raise CheckpointError(f"{item}/{name}{'' if layer is None else f' layer {layer}'}: got "
                                  f"{array.dtype.name}{list(array.shape)}, the checkpoint needs "
                                  f"{leaf.meta['dtype']}{want}")
        nbytes = array.nbytes
        slot = aligned_empty((chunkfile.slot_bytes(nbytes),), np.uint8, chunkfile.BLOCK)
        slot[:nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        index = (layer, *[0] * len(want)) if layer is not None else (0,) * len(want)
        path = chunkfile.chunk_path(os.path.join(self.tmp, item, name), index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        chunkfile.write_chunks([(path, slot, nbytes)], sync=False, atomic=True)
        self._written.add((item, name, layer))
        self.bytes_written += nbytes

    def _leaf(self, item: str, name: str) -> Leaf:
        try:
            return self.leaves[item][name]
        except KeyError:
            raise CheckpointError(f"{item}/{name} is not a leaf of this checkpoint; its leaves are "
                                  f"{', '.join(sorted(self.leaves.get(item, {})))}") from None

    def missing(self) -> list[str]:
        """The chunks not written yet, as ``item/name[layer]``."""
        out = []
        for item, leaves in self.leaves.items():
            for name, leaf in leaves.items():
                layers = range(leaf.meta["shape"][0]) if leaf.stacked else [None]
                out += [f"{item}/{name}" + ("" if i is None else f"[{i}]") for i in layers
                        if (item, name, i) not in self._written]
        return out

    def commit(self) -> str:
        """Checks every chunk is there, writes the metadata and makes the checkpoint visible; returns its path."""
        missing = self.missing()
        if missing:
            raise CheckpointError(f"{len(missing)} chunks were never written, e.g. {', '.join(missing[:5])}")
        parts = [_Part(item, [leaf for leaf in leaves.values()]) for item, leaves in self.leaves.items()]
        _write_metadata(self.tmp, parts, self._meta())
        _syncfs(self.tmp)
        final = fmt.step_dir(self.save_dir, self.step)
        _commit(self.tmp, final)
        return final

    def _meta(self) -> dict:
        def nbytes(item):
            return sum(int(np.prod(leaf.meta["shape"])) * np.dtype(leaf.meta["dtype"]).itemsize
                       for leaf in self.leaves[item].values())

        blocks = [leaf for leaf in self.leaves["params"].values() if leaf.stacked]
        config = self.config.to_dict() if self.config is not None else {}
        meta = {
            "format_version": fmt.FORMAT_VERSION, "step": self.step, "data_position": self.data_position,
            "seed": config.get("seed", 0), "loss_scale": 1.0, "precision": config.get("precision", "fp32"),
            "num_layers": blocks[0].meta["shape"][0] if blocks else 0, "processes": 1, "devices": 0,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
            "model": dataclasses.asdict(self.model) if dataclasses.is_dataclass(self.model) else None,
            "tiers": {"converted": {"bytes": nbytes("params") + nbytes("opt_state"), "stores": list(fmt.ITEMS)}},
            "items": {item: {n: leaf.meta for n, leaf in leaves.items()} for item, leaves in self.leaves.items()},
        }
        return {**meta, "base": self.base} if self.base else meta

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def write_params(save_dir: str, params, tx=None, step: int = 0, config=None, model=None,
                 stacked=stacked_blocks) -> str:
    """A checkpoint ``<save_dir>/<step>`` of a parameter tree held in memory, in fp32, with ``tx``'s fresh optimizer
    state (none without ``tx``: a run starts it afresh); returns its directory. What a converter writes when it
    holds the whole tree; ``config`` and ``model`` are recorded as `CheckpointWriter` records them.

    Example:
        >>> import jax, jax.numpy as jnp, optax, tempfile
        >>> from zinfjax.models import ModelConfig, build
        >>> model = ModelConfig.named("gpt2-tiny")
        >>> params = jax.jit(build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> path = write_params(tempfile.mkdtemp(), params, optax.adamw(1e-3), model=model)
        >>> fmt.read_meta(path)["items"]["opt_state"]["0.mu.blocks.fc.kernel"]["shape"]
        [4, 64, 256]
    """
    f32 = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    trees = {"params": f32, "opt_state": jax.tree.map(np.asarray, tx.init(f32)) if tx is not None else None}
    leaves = expected_leaves(f32, tx if tx is not None else optax.set_to_zero(), stacked)
    leaves["opt_state"] = leaves["opt_state"] if tx is not None else {}
    with CheckpointWriter(save_dir, step, leaves, config=config, model=model) as writer:
        for item, tree in trees.items():
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if tree is not None else []:
                name = leaf_name(path_str(p))
                for layer in range(x.shape[0]) if leaves[item][name].stacked else [None]:
                    writer.write(item, name, layer, x if layer is None else x[layer])
    return fmt.step_dir(writer.save_dir, step)


@dataclasses.dataclass
class _Part:
    item: str
    leaves: list[Leaf]
