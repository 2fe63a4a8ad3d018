"""Restoring a checkpoint into an engine of any mesh, stage, process count or tiers.

A checkpoint holds every leaf whole, in the user's tree layout (its chunks are device shards of
the mesh it was saved on), so a restore reads each slice the new engine asks for (a layer, a
row chunk, a whole leaf) with every chunk's crc32c checked (`LeafReader`), and the engine's stores
split it their own way. Memory stays at one slice, as when training.

Example:
    >>> source = CheckpointSource("runs/ckpt", program, plan)
    >>> engine = Engine(program, source, tx, config, mesh)
    >>> engine.step_count == source.step
    True
"""

from __future__ import annotations

import os

import numpy as np

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointMismatchError
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.checkpoint.reader import LeafReader
from zinfjax.checkpoint.snapshot import leaf_name


def expected_items(program, plan, params_dtype=np.float32) -> dict[str, dict[str, dict]]:
    """The leaves (``{item: {name: {"shape", "dtype"}}}``) a checkpoint of this program and optimizer holds."""
    params = {leaf_name(x.path): {"shape": list(x.shape), "dtype": np.dtype(params_dtype).name}
              for x in program.leaves}
    state = {leaf_name(s.path): {"shape": list(plan.user_shape(s)), "dtype": np.dtype(s.dtype).name}
             for s in plan.state}
    return {"params": params, "opt_state": state}


class CheckpointSource:
    """An engine's initial state read from a checkpoint, one slice at a time.

    Attributes:
        directory: the checkpoint read.
        step: the optimizer steps it had taken.
        data_position: where the resumed run takes its next batch.
    """

    def __init__(self, path: str, program, plan):
        self.directory = latest_checkpoint(path)
        self.program, self.plan = program, plan
        self.meta = fmt.read_meta(self.directory)
        self.step = int(self.meta["step"])
        self.data_position = int(self.meta.get("data_position", self.step))
        self.loss_scale = float(self.meta.get("loss_scale", 1.0))
        self.loss_scale_good = int(self.meta.get("loss_scale_good", 0))
        self.check()
        hint = f"restore an earlier step (zinfjax ckpt info {os.path.dirname(self.directory)} lists them)"
        self._reader = LeafReader(self.directory, self.meta["items"], hint)

    def check(self) -> None:
        """Refuses a checkpoint whose leaves (names, shapes) differ from the run's."""
        if int(self.meta.get("format_version", 1)) != fmt.FORMAT_VERSION:
            raise CheckpointMismatchError(
                f"the checkpoint {self.directory} has format version {self.meta.get('format_version', 1)}; this "
                f"zinfjax reads version {fmt.FORMAT_VERSION} (its parameters restore with plain orbax: "
                "ocp.PyTreeCheckpointer().restore(<checkpoint>/params))")
        missing, extra, shapes = [], [], []
        for item, wanted in expected_items(self.program, self.plan).items():
            saved = self.meta["items"].get(item, {})
            missing += [f"{item}/{n}: missing from the checkpoint" for n in sorted(set(wanted) - set(saved))]
            extra += [f"{item}/{n}: in the checkpoint but not in this run" for n in sorted(set(saved) - set(wanted))]
            shapes += [f"{item}/{n}: checkpoint {saved[n]['dtype']}{saved[n]['shape']}, run "
                       f"{wanted[n]['dtype']}{wanted[n]['shape']}"
                       for n in sorted(set(saved) & set(wanted)) if list(saved[n]["shape"]) != wanted[n]["shape"]]
        problems = missing + extra + shapes
        if problems:
            shown = missing[:2] + extra[:2] + shapes[:2]  # a few of each kind, on one line
            more = f"; and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
            raise CheckpointMismatchError(
                f"the checkpoint {self.directory} was saved from another model or optimizer "
                f"({len(problems)} leaves differ: {'; '.join(shown)}{more}); restore it with the model and "
                "optimizer it was trained with (zinfjax ckpt info shows them), or start without restoring")

    # ---- the source interface ------------------------------------------------------------------

    def params(self, group: str, i: int) -> list:
        return [self._slice("params", leaf_name(x.path), x, i) for x in self.program.leaves_of(group)]

    def state(self, group: str, i: int) -> list:
        return [self._slice("opt_state", leaf_name(s.path), self.program.leaves[s.param], i)
                for s in self.plan.state_of(group)]

    def globals(self) -> list:
        return [self._reader.read("opt_state", leaf_name(s.path), None) for s in self.plan.globals]

    def _slice(self, item: str, name: str, leaf, i: int) -> np.ndarray:
        """Slice ``i`` of a leaf as the engine's store holds it (a layer, a padded row chunk, or all of it)."""
        stream = leaf.stream
        if stream is None:
            return self._reader.read(item, name, None)
        if stream.tiles:  # one tile: a block of the layer, whatever tiles (if any) the checkpoint was saved in
            layer, t = divmod(i, stream.tiles)
            if stream.axis is None:
                return self._reader.read_block(item, name, (layer, t))
            size = leaf.shape[1 + stream.axis] // stream.tiles
            return self._reader.read_block(item, name, (layer, *[slice(None)] * stream.axis,
                                                        slice(t * size, (t + 1) * size)))
        if stream.rows == 0:
            return self._reader.read(item, name, i)
        rows = self._reader.read_rows(item, name, i * stream.rows, min((i + 1) * stream.rows, leaf.shape[0]))
        pad = stream.rows - rows.shape[0]
        return np.pad(rows, [(0, pad)] + [(0, 0)] * (rows.ndim - 1)) if pad else rows

    def close(self) -> None:
        self._reader.close()
