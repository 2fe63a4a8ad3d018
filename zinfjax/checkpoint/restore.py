"""Restoring a checkpoint into an engine of any mesh, stage, process count or tiers.

A checkpoint holds every leaf whole, in the user's tree layout (its chunks are device shards of
the mesh it was saved on), so a restore reads each slice the new engine asks for (a layer, a
row chunk, a whole leaf) with every chunk's crc32c checked (`LeafReader`), and the engine's stores
split it their own way. Memory stays at one slice, as when training.

A fine-tune's checkpoint holds its trainable leaves alone and names its frozen base
(`zinfjax.checkpoint.base`): the base's leaves are read from there, its digest checked first. A run
that starts from a checkpoint (``model=<checkpoint>``, `start=True`) takes its parameters and leaves
the optimizer state, the step and the data position to start afresh; leaves the checkpoint lacks (new
LoRA adapters) come from ``fallback``, the run's own initialiser.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.checkpoint.writer import write_params
    >>> from zinfjax.engine import Engine, update_plan
    >>> from zinfjax.program import program_for
    >>> from zinfjax.sharding import make_mesh
    >>> def loss_fn(params, batch):                         # three layers: a scan over their stacked weights
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"]["w"])
    ...     return jnp.mean(h ** 2)
    >>> params, tx = {"blocks": {"w": np.ones((3, 8, 8), np.float32) / 8}}, optax.adam(1e-3)
    >>> save_dir = tempfile.mkdtemp()
    >>> path = write_params(save_dir, params, tx, step=5)   # step 5: the parameters and a fresh Adam state
    >>> program = program_for(loss_fn, params, jnp.ones((8, 8)))
    >>> source = CheckpointSource(save_dir, program, update_plan(tx, program))
    >>> engine = Engine(program, source, tx, Config(params="host").engine_settings(), make_mesh({"data": 1}))
    >>> engine.step_count == source.step == 5
    True
    >>> engine.close()
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.base import base_ref, check_base
from zinfjax.checkpoint.errors import CheckpointMismatchError
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.checkpoint.reader import LeafReader
from zinfjax.checkpoint.snapshot import leaf_name
from zinfjax.sharding import path_str


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
        step: the optimizer steps it had taken (0 for a start).
        data_position: where the resumed run takes its next batch.
        base: the frozen base (``{"path", "digest"}``) the parameters it lacks are read from, or None.
    """

    def __init__(self, path: str, program, plan, start: bool = False, fallback=None):
        self.directory = latest_checkpoint(path)
        self.program, self.plan, self.start, self.fallback = program, plan, start, fallback
        self.meta = fmt.read_meta(self.directory)
        self.step = 0 if start else int(self.meta["step"])
        self.data_position = 0 if start else int(self.meta.get("data_position", self.step))
        self.loss_scale = None if start else float(self.meta.get("loss_scale", 1.0))
        self.loss_scale_good = 0 if start else int(self.meta.get("loss_scale_good", 0))
        hint = f"restore an earlier step (zinfjax ckpt info {os.path.dirname(self.directory)} lists them)"
        self._reader = LeafReader(self.directory, self.meta["items"], hint)
        self._base = None
        if self.meta.get("base"):
            self.base = self.meta["base"]
            base_dir = check_base(self.base, self.directory)
            self._base = LeafReader(base_dir, fmt.read_meta(base_dir)["items"], "convert the base again")
        else:  # a start's base is the checkpoint itself, whose frozen leaves the run's checkpoints then name
            self.base = base_ref(self.directory) if start else None
        self._state = not start and bool(self.meta["items"]["opt_state"])
        self.check()

    def check(self) -> None:
        """Refuses a checkpoint whose leaves (names, shapes) differ from the run's."""
        if int(self.meta.get("format_version", 1)) != fmt.FORMAT_VERSION:
            raise CheckpointMismatchError(
                f"the checkpoint {self.directory} has format version {self.meta.get('format_version', 1)}; this "
                f"zinfjax reads version {fmt.FORMAT_VERSION} (its parameters restore with plain orbax: "
                "ocp.PyTreeCheckpointer().restore(<checkpoint>/params))")
        missing, extra, shapes = [], [], []
        for item, wanted in expected_items(self.program, self.plan).items():
            if item == "opt_state" and not self._state:
                continue  # a start, or an adapter converted without one: the optimizer starts afresh
            saved = dict(self.meta["items"].get(item, {}))
            if item == "params":
                base = self._base.items["params"] if self._base is not None else {}
                saved = {**{n: m for n, m in base.items() if n in wanted}, **saved}
                if self.fallback is not None:  # a start: the run initialises what the checkpoint lacks
                    wanted = {n: m for n, m in wanted.items() if n in saved}
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

    def params(self, group: str, i: int, only: frozenset | None = None) -> list:
        leaves = self.program.leaves_of(group)
        wanted = [only is None or x.path in only for x in leaves]
        readers = [self._holder(leaf_name(x.path)) for x in leaves]
        new = frozenset(x.path for x, r, w in zip(leaves, readers, wanted, strict=True) if r is None and w)
        made = self.fallback.params(group, i, new) if new else None  # the leaves no checkpoint holds
        return [None if not w else made[j] if r is None else self._slice(r, "params", leaf_name(x.path), x, i)
                for j, (x, r, w) in enumerate(zip(leaves, readers, wanted, strict=True))]

    def state(self, group: str, i: int) -> list | None:
        if not self._state:
            return None
        return [self._slice(self._reader, "opt_state", leaf_name(s.path), self.program.leaves[s.param], i)
                for s in self.plan.state_of(group)]

    def globals(self) -> list | None:
        if not self._state:
            return None
        return [self._reader.read("opt_state", leaf_name(s.path), None) for s in self.plan.globals]

    def base_leaves(self) -> frozenset[int]:
        """The program's leaves read from the base (none without one): what the run's checkpoints need not hold."""
        if self.base is None:
            return frozenset()
        own = self.meta["items"]["params"] if self._base is not None else {}
        return frozenset(x.index for x in self.program.leaves if leaf_name(x.path) not in own
                         and self._holder(leaf_name(x.path)) is not None)

    def leaf_dir(self, path: str) -> tuple[str, dict] | None:
        """The directory and metadata of the base's params leaf ``path`` (None: not a base leaf)."""
        name = leaf_name(path)
        reader = self._holder(name)
        if reader is None or self.base is None or (reader is self._reader and self._base is not None):
            return None
        return os.path.join(reader.directory, "params", name), reader.items["params"][name]

    def _holder(self, name: str) -> LeafReader | None:
        """The reader that holds params leaf ``name``: the checkpoint's, its base's, or None."""
        if name in self.meta["items"]["params"]:
            return self._reader
        if self._base is not None and name in self._base.items["params"]:
            return self._base
        return None

    @staticmethod
    def _slice(reader: LeafReader, item: str, name: str, leaf, i: int) -> np.ndarray:
        """Slice ``i`` of a leaf as the engine's store holds it (a layer, a padded row chunk, or all of it)."""
        stream = leaf.stream
        if stream is None:
            return reader.read(item, name, None)
        if stream.tiles:  # one tile: a block of the layer, whatever tiles (if any) the checkpoint was saved in
            layer, t = divmod(i, stream.tiles)
            if stream.axis is None:
                return reader.read_block(item, name, (layer, t))
            size = leaf.shape[1 + stream.axis] // stream.tiles
            return reader.read_block(item, name, (layer, *[slice(None)] * stream.axis,
                                                  slice(t * size, (t + 1) * size)))
        if stream.rows == 0:
            return reader.read(item, name, i)
        rows = reader.read_rows(item, name, i * stream.rows, min((i + 1) * stream.rows, leaf.shape[0]))
        pad = stream.rows - rows.shape[0]
        return np.pad(rows, [(0, pad)] + [(0, 0)] * (rows.ndim - 1)) if pad else rows

    def close(self) -> None:
        self._reader.close()
        if self._base is not None:
            self._base.close()


def start_params(path: str, params):
    """``params`` (a run's own initial parameters, in memory) with every leaf the checkpoint ``path`` or its base
    holds replaced by the saved one: what an in-memory run starting from a checkpoint trains.

    Raises:
        CheckpointMismatchError: a saved leaf's shape differs from the run's.
    """
    directory = latest_checkpoint(path)
    meta = fmt.read_meta(directory)
    readers = [LeafReader(directory, meta["items"])]
    if meta.get("base"):
        base = check_base(meta["base"], directory)
        readers.append(LeafReader(base, fmt.read_meta(base)["items"]))

    def one(keypath, x):
        name = leaf_name(path_str(keypath))
        reader = next((r for r in readers if name in r.items["params"]), None)
        if reader is None:
            return x
        saved = reader.items["params"][name]
        if tuple(saved["shape"]) != tuple(x.shape):
            raise CheckpointMismatchError(f"the checkpoint {directory} holds params/{name} of shape "
                                          f"{tuple(saved['shape'])}; the run's is {tuple(x.shape)}")
        return jnp.asarray(reader.read("params", name, None), x.dtype)

    try:
        return jax.tree_util.tree_map_with_path(one, params)
    finally:
        for r in readers:
            r.close()
