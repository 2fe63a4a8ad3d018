"""Restoring a checkpoint into an engine of any mesh, stage, process count or tiers.

A checkpoint holds every leaf whole (its chunks are one device shard each, of the mesh it was
saved on), so restoring reads each layer whole (`LeafReader`: one direct read where the layer is
one chunk, else tensorstore; every chunk's crc32c checked) and writes it into the new engine's
stores, which split it their own way. Memory stays at one layer, as when training.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointMismatchError
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.checkpoint.reader import LeafReader
from zinfjax.checkpoint.snapshot import Part, parts_of


class CheckpointSource:
    """The initial state of an `Engine`, read from a checkpoint instead of initialised.

    ``abstract`` is the run's parameter tree (shapes and dtypes; blocks stacked).

    Example:
        >>> source = CheckpointSource("runs/ckpt", jax.eval_shape(init, key))
        >>> engine = Engine(model.layers(), source, tx, config, mesh, batch_shape)
        >>> engine.step_count == source.step
        True
    """

    def __init__(self, path: str, abstract):
        self.directory = latest_checkpoint(path)
        self.meta = fmt.read_meta(self.directory)
        self.abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), abstract)
        self.step = int(self.meta["step"])
        self.data_position = int(self.meta.get("data_position", self.step))
        hint = f"restore an earlier step (zinfjax ckpt info {os.path.dirname(self.directory)} lists them)"
        self._reader = LeafReader(self.directory, self.meta["items"], hint)

    def fill(self, engine) -> None:
        """Writes the checkpoint's state into ``engine``'s (empty) stores, one layer at a time."""
        parts = {(p.item, p.group): p for p in parts_of(engine)}
        self.check(parts.values())
        s = engine.stores
        for g in s.params:
            n = s.params[g].num_layers
            for i in range(n):
                master = self.read_layer(parts["params", g], i)
                opt = self.read_layer(parts["opt_state", g], i)
                compute = jax.tree.map(lambda x: jnp.asarray(x).astype(engine.compute_dtype), master)
                s.params[g].write(i, compute)
                s.opt[g].write(i, opt)
                if s.master:
                    s.master[g].write(i, master)
            engine.stores.flush()
        engine.step_count = self.step
        engine.loss_scale.scale = float(self.meta.get("loss_scale", engine.loss_scale.scale))

    def check(self, parts) -> None:
        """Refuses a checkpoint whose leaves (names, shapes, dtypes) differ from the run's."""
        problems = []
        for item in fmt.ITEMS:
            saved = self.meta["items"].get(item, {})
            wanted = {leaf.name: leaf.meta for p in parts if p.item == item for leaf in p.leaves}
            problems += [f"{item}/{n}: missing from the checkpoint" for n in sorted(set(wanted) - set(saved))]
            problems += [f"{item}/{n}: in the checkpoint but not in this run" for n in sorted(set(saved) - set(wanted))]
            for n in sorted(set(saved) & set(wanted)):
                a, b = saved[n], wanted[n]
                if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
                    problems.append(f"{item}/{n}: checkpoint {a['dtype']}{a['shape']}, run {b['dtype']}{b['shape']}")
        if problems:
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            shown = "\n  ".join(problems[:20]) + more
            raise CheckpointMismatchError(
                f"the checkpoint {self.directory} was saved from another model or optimizer "
                f"({len(problems)} leaves differ):\n  {shown}\nrestore it with the model and optimizer it was "
                "trained with (zinfjax ckpt info shows them), or start without restoring")

    def read_layer(self, part: Part, i: int):
        """Layer ``i`` of one store's leaves, whole, as numpy arrays in the store's tree."""
        leaves = [self._read(part.item, leaf.name, i if part.group == "blocks" else None) for leaf in part.leaves]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(part.store.like), leaves)

    def _read(self, item: str, name: str, layer: int | None) -> np.ndarray:
        return self._reader.read(item, name, layer)
