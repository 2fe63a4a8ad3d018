"""`CheckpointManager`: step-numbered, asynchronous, atomic checkpoints of a wrapped state.

A save takes the step's state out of the stores between two steps (hard links for nvme,
array references for device and host, see `snapshot`) and returns; a background thread makes
the files durable, writes the metadata, and renames ``<save_dir>/.tmp-<step>`` to
``<save_dir>/<step>``. Only that rename makes a checkpoint visible, so a crash at any point
leaves the previous checkpoints as they were and no half checkpoint under a step number.

Under `zinfjax launch` every process writes the chunks it holds into the same directory, and
process 0 writes the metadata and renames once all have finished.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import os
import shutil
import time
import uuid
from concurrent.futures import Future

import jax
import numpy as np

from zinfjax._util.byte_sizes import format_bytes
from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointNotFoundError, CheckpointSaveError
from zinfjax.checkpoint.identity import new_run_id
from zinfjax.checkpoint.snapshot import Part, Snapshot, parts_of
from zinfjax.checkpoint.verify import DELETING, leftovers
from zinfjax.runtime.distributed import barrier
from zinfjax.store.disk import free_bytes, is_disk_full
from zinfjax.store.manifest import fsync_dir
from zinfjax.store.split import pieces_of
from zinfjax.store.threads import executor


class CheckpointManager:
    """Saves and finds the checkpoints of one run under ``directory``, keeping the newest ``keep``.

    Example:
        >>> import jax, jax.numpy as jnp, optax, tempfile, zinfjax
        >>> from flax.training import train_state
        >>> def loss_fn(params, batch):                     # three layers: a scan over their stacked weights
        ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
        ...     return jnp.mean(h ** 2)
        >>> train = train_state.TrainState.create(apply_fn=None, params={"blocks": jnp.ones((3, 8, 8)) / 8},
        ...                                       tx=optax.adam(1e-3))
        >>> state = zinfjax.wrap(train, zinfjax.Config(params="nvme", nvme_path=tempfile.mkdtemp()), loss_fn=loss_fn)
        >>> manager = CheckpointManager(tempfile.mkdtemp(), keep=2)
        >>> for step in range(1, 4):
        ...     state, metrics = state.train_step(jnp.ones((8, 8)))
        ...     _ = manager.save(state, data_position=step)  # returns at once; training goes on
        >>> manager.wait()                                    # raises CheckpointSaveError if it failed
        >>> manager.steps()                                   # the newest two
        [2, 3]
        >>> manager.close(); state.close()
        >>> later = zinfjax.wrap(train, zinfjax.Config(), loss_fn=loss_fn, restore=manager.directory)  # any tiers
    """

    def __init__(self, directory: str, keep: int = 3, config=None, model=None, run_id: str | None = None):
        if keep < 1:
            raise CheckpointSaveError(f"keep={keep}: a manager keeps at least the newest checkpoint (keep >= 1)")
        self.directory, self.keep = os.path.abspath(directory), keep
        self.config, self.model = config, model
        self.run_id = run_id  # the run these checkpoints belong to; made at the first save when not given
        self.protect: int | None = None  # a step pruning keeps even beyond `keep` (see zinfjax.training.loop.Saver)
        self._executor = executor(1, "zinf-ckpt")
        self._pending: Future | None = None
        self.last_error: CheckpointSaveError | None = None  # of the previous save, reported by `save`
        self._prepare()

    def _prepare(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".probe-{os.getpid()}")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise CheckpointSaveError(f"cannot write checkpoints to {self.directory}: {e.strerror}; choose a "
                                      "writable save_dir") from e
        if jax.process_index() == 0:  # a save or a deletion cut short by a crash left its directory
            for name in leftovers(self.directory):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    # ---- saving ----------------------------------------------------------------------------------

    def save(self, state, step: int | None = None, data_position: int | None = None) -> int:
        """Starts saving ``state`` (a `WrappedState` or an `Engine`) as checkpoint ``step``; returns the step.

        It waits for the previous save first, then returns as soon as the step's state is out of
        the stores. A failure of the previous save is reported then (and by `wait`), not raised:
        the previous checkpoints are intact and training can go on.
        """
        engine = getattr(state, "engine", state)
        step = engine.step_count if step is None else int(step)
        self.last_error = self.wait(raise_error=False)
        engine.stores.flush()
        tmp = os.path.join(self.directory, f".tmp-{step}")
        if jax.process_index() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier(f"zinfjax-ckpt-{step}-begin")
        base = getattr(engine, "base", None)  # a fine-tune's frozen base: named, not saved again
        parts = parts_of(engine, engine.base_leaves if base else frozenset())
        meta = self._meta(engine, self._given(state, engine), parts, step, data_position)
        if base:
            meta["base"] = base
        snapshot = Snapshot(tmp, _staging_dir(engine, step))
        try:
            snapshot.take(parts)
        except OSError as e:
            snapshot.discard()
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._save_error(step, e) from e
        self._pending = self._executor.submit(self._commit_in_background, snapshot, parts, meta, tmp, step)
        return step

    def wait(self, raise_error: bool = True) -> CheckpointSaveError | None:
        """Waits for the save in flight; raises (or, with ``raise_error=False``, returns) its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.result()
        except CheckpointSaveError as e:
            if raise_error:
                raise
            return e
        return None

    def _commit_in_background(self, snapshot: Snapshot, parts: list[Part], meta: dict, tmp: str, step: int) -> None:
        try:
            snapshot.write()
            barrier(f"zinfjax-ckpt-{step}-written")
            if jax.process_index() == 0:
                _write_metadata(tmp, parts, meta)
                _syncfs(tmp)
                _commit(tmp, fmt.step_dir(self.directory, step))
                self._prune()
            barrier(f"zinfjax-ckpt-{step}-committed")
        except OSError as e:
            snapshot.discard()
            if jax.process_index() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._save_error(step, e) from e

    def _save_error(self, step: int, e: OSError) -> CheckpointSaveError:
        previous = [s for s in self.steps() if s != step]  # not the failed step, whatever is left of it
        kept = (f"the previous checkpoint (step {previous[-1]}) is intact" if previous
                else "no earlier checkpoint exists")
        if is_disk_full(e):
            what = (f"the disk holding {self.directory} is full ({format_bytes(free_bytes(self.directory))} free); "
                    "free some space or point save_dir at a larger disk")
        else:
            what = f"{e.strerror or e} ({getattr(e, 'filename', None) or self.directory}); check save_dir"
        error = CheckpointSaveError(f"checkpoint of step {step} failed: {what}; {kept}, and training can go on")
        error.step, error.reason = step, what
        return error

    def _given(self, state, engine) -> dict:
        """The config the checkpoint records, as the user gave it: the manager's, else the wrapped state's (never what
        the engine derived from it: its budget and update place are the engine's own); for a bare engine, the
        settings it was built from (`zinfjax.sections.EngineSettings`), as flat keys."""
        config = self.config or getattr(state, "config", None)
        return config.to_dict() if config is not None else engine.settings.to_dict()

    def _meta(self, engine, config: dict, parts: list[Part], step: int, data_position: int | None) -> dict:
        tiers: dict[str, dict] = {}
        for part in parts:
            nbytes = sum(_nbytes(leaf.meta) for leaf in part.leaves)
            for tier, share in _tier_shares(part.store):
                entry = tiers.setdefault(tier, {"bytes": 0, "stores": []})
                entry["bytes"] += int(nbytes * share)
                entry["stores"].append(f"{part.item}/{part.group}")
        return {
            "format_version": fmt.FORMAT_VERSION,
            "step": step,
            "data_position": step if data_position is None else int(data_position),
            "seed": config["seed"],
            "loss_scale": engine.loss_scale.value,
            "loss_scale_good": engine.loss_scale.good,
            "precision": engine.settings.numerics.precision,
            "num_layers": engine.num_layers,
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "run_id": self._run_id(),
            "config": config,
            "model": _model_dict(self.model),
            "tiers": tiers,
            "items": {item: {leaf.name: leaf.meta for p in parts if p.item == item for leaf in p.leaves}
                      for item in fmt.ITEMS},
        }

    def _run_id(self) -> str:
        if self.run_id is None:
            self.run_id = new_run_id()
        return self.run_id

    def prune(self) -> None:
        """Deletes the checkpoints beyond the newest ``keep`` (but `protect`); a save does this itself."""
        self.wait(raise_error=False)
        if jax.process_index() == 0:  # as in a save: one process deletes
            self._prune()

    def _prune(self) -> None:
        for old in self.steps()[: -self.keep]:
            if old != self.protect:
                try:
                    discard(fmt.step_dir(self.directory, old))
                except OSError:
                    pass  # an old checkpoint that cannot be deleted stays whole; the new one is saved

    # ---- finding -----------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The complete checkpoints, oldest first."""
        return fmt.complete_steps(self.directory)

    def latest(self) -> str:
        """The directory of the newest complete checkpoint."""
        return latest_checkpoint(self.directory)

    def close(self) -> None:
        """Waits for the save in flight (raising its error) and stops the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def latest_checkpoint(path: str) -> str:
    """``path`` itself if it is one checkpoint, else the newest complete checkpoint under it.

    Example:
        >>> import numpy as np, tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> save_dir = tempfile.mkdtemp()
        >>> for step in (50, 100):
        ...     path = write_params(save_dir, {"w": np.ones(4, np.float32)}, step=step)
        >>> latest_checkpoint(save_dir) == f"{save_dir}/100", latest_checkpoint(f"{save_dir}/50") == f"{save_dir}/50"
        (True, True)
    """
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, fmt.META)):
        return path
    steps = fmt.complete_steps(path)
    if not steps:
        raise CheckpointNotFoundError(f"no complete checkpoint in {path}; train with save_dir={path} first, or "
                                      "give the directory of one checkpoint (<save_dir>/<step>)")
    return fmt.step_dir(path, steps[-1])


def _write_metadata(tmp: str, parts: list[Part], meta: dict) -> None:
    keys: dict[str, dict] = {item: {} for item in fmt.ITEMS}
    for part in parts:
        for leaf in part.leaves:
            leaf_dir = os.path.join(tmp, part.item, leaf.name)
            os.makedirs(leaf_dir, exist_ok=True)
            fmt.write_json(os.path.join(leaf_dir, "zarr.json"), fmt.zarr_metadata(leaf.meta))
            keys[part.item][leaf.name] = leaf.keypath
    for item, leaves in keys.items():  # an item may hold no leaf (an adapter converted without optimizer state)
        os.makedirs(os.path.join(tmp, item), exist_ok=True)
        fmt.write_json(os.path.join(tmp, item, fmt.ORBAX_METADATA), fmt.orbax_metadata(leaves))
    fmt.write_json(os.path.join(tmp, fmt.META), meta)


def _commit(tmp: str, final: str) -> None:
    """Makes the checkpoint visible: one rename, then the parent directory made durable."""
    replaced = None
    if os.path.exists(final):  # the same step saved again (a resumed run): the new one replaces it
        replaced = _set_aside(final)
    os.rename(tmp, final)
    try:
        fsync_dir(os.path.dirname(final))
    except OSError:  # the disk failed the sync that makes the rename durable: not a checkpoint to list
        shutil.rmtree(final, ignore_errors=True)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def discard(step_directory: str) -> None:
    """Deletes a checkpoint: first renamed out of the step namespace, so a crash never leaves half of it there."""
    shutil.rmtree(_set_aside(step_directory), ignore_errors=True)


def _set_aside(step_directory: str) -> str:
    parent, name = os.path.split(step_directory)
    aside = os.path.join(parent, f"{DELETING}{name}-{uuid.uuid4().hex[:8]}")
    os.rename(step_directory, aside)
    fsync_dir(parent)  # the rename is durable before any file of the checkpoint goes
    return aside


def _syncfs(path: str) -> None:
    """Flushes the filesystem of ``path`` (every file and directory entry the checkpoint made)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def _staging_dir(engine, step: int) -> str | None:
    """Where nvme chunks are linked first when the checkpoint is on another filesystem."""
    path = engine.settings.tiering.nvme_path
    return os.path.join(os.path.abspath(path), f".checkpoint-{step}") if path else None


def _model_dict(model) -> dict | None:
    if model is None:
        return None
    return dataclasses.asdict(model) if dataclasses.is_dataclass(model) else {"name": str(model)}


def _tier_shares(store) -> list[tuple[str, float]]:
    """The tiers a part's store keeps it on, and each one's share of its layers ("memory": the optimizer's globals)."""
    if store is None:
        return [("memory", 1.0)]
    pieces = pieces_of(store)
    return [(piece.tier, piece.num_layers / store.num_layers) for _, piece in pieces]


def _nbytes(meta: dict) -> int:
    return int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize
