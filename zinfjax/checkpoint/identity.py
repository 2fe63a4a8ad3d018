"""A save_dir belongs to one run: its checkpoints record the run's id and model, and a run must match them.

A fresh run (without ``resume``) into a save_dir that holds checkpoints is refused before training,
unless ``overwrite=true``, which moves them aside to ``<save_dir>/.replaced-<time>/`` (nothing is
deleted). A resumed run keeps the run id of its checkpoint, and is refused when its config
changes the mathematics of the run the checkpoint belongs to (`RESUME_KEYS`, and the model),
unless ``allow_config_change=true``.

A checkpoint without a run id (one written by ``zinfjax convert``) is a starting point, not a run:
resuming from it checks only the model, and the first save makes the new run's id.

Example:
    >>> import numpy as np, tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.checkpoint.writer import write_params
    >>> save_dir = tempfile.mkdtemp()
    >>> for step in (2, 4, 6):
    ...     path = write_params(save_dir, {"w": np.ones(4, np.float32)}, step=step)
    >>> check_fresh(Config(save_dir=save_dir))
    Traceback (most recent call last):
    zinfjax.checkpoint.identity.SaveDirInUseError: save_dir ... holds ... another run (steps 2, 4, 6); ...
    >>> check_fresh(Config(save_dir=save_dir, overwrite=True))
    'overwrite=true: moved the checkpoints of the previous run (steps 2, 4, 6) aside to .../.replaced-...'
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid

import jax

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointError
from zinfjax.store.manifest import fsync_dir

# The keys whose change makes a resumed run another computation than the one its checkpoint began.
RESUME_KEYS = ("seed", "optimizer_name", "lr", "weight_decay", "grad_clip", "grad_accum", "batch_size", "seq_len",
               "data")


class SaveDirInUseError(CheckpointError):
    """A fresh run into a save_dir that holds another run's checkpoints."""


class ResumeMismatchError(CheckpointError):
    """A resume whose config changes the mathematics of the checkpoint's run."""


def new_run_id() -> str:
    """A new run's id: 12 random hex digits."""
    return uuid.uuid4().hex[:12]


def check_fresh(config) -> str | None:
    """Lets a run without ``resume`` start in ``config.save_dir``; returns a note when it moved checkpoints aside.

    Raises:
        SaveDirInUseError: the save_dir holds checkpoints and ``overwrite`` is not set.
    """
    save_dir = os.path.abspath(config.save_dir)
    steps = fmt.step_names(save_dir)
    if not steps:
        return None
    if not config.overwrite:
        raise SaveDirInUseError(
            f"save_dir {save_dir} holds the checkpoints of another run ({owner(save_dir, steps)}); continue that run "
            "with resume=true, choose another save_dir, or set overwrite=true to move them aside")
    if jax.process_index() != 0:
        return None  # process 0 moves them
    aside = set_aside(save_dir, steps, "replaced")
    return f"overwrite=true: moved the checkpoints of the previous run (steps {_steps(steps)}) aside to {aside}"


def owner(save_dir: str, steps: list[int]) -> str:
    """``steps 2, 4, 6; run 3f2a...; model gpt2-tiny; seed 0``: what a save_dir holds, from its newest metadata."""
    parts = [f"step{'s' if len(steps) > 1 else ''} {_steps(steps)}"]
    try:
        meta = fmt.read_meta(fmt.step_dir(save_dir, steps[-1]))
    except CheckpointError:
        return parts[0]  # no readable metadata: the steps say enough
    config = meta["config"]
    if meta.get("run_id"):
        parts.append(f"run {meta['run_id']}")
    if "model" in config:
        parts.append(f"model {config['model']}")
    if "seed" in config:
        parts.append(f"seed {config['seed']}")
    return "; ".join(parts)


def set_aside(save_dir: str, steps: list[int], label: str) -> str:
    """Moves step directories out of the step namespace into ``<save_dir>/.<label>-<time>/``; returns that path.

    Each move is one rename, so a crash leaves every checkpoint either in its place or aside, whole.
    """
    aside = os.path.join(save_dir, f".{label}-{time.strftime('%Y%m%d-%H%M%S')}")
    while os.path.exists(aside):
        aside += "x"
    os.makedirs(aside)
    for step in steps:
        os.rename(fmt.step_dir(save_dir, step), os.path.join(aside, str(step)))
    fsync_dir(save_dir)
    return aside


def check_resume(meta: dict, directory: str, config, model_config) -> str | None:
    """Lets ``config`` resume from the checkpoint ``directory`` (its metadata ``meta``); a note if it changes things.

    Raises:
        ResumeMismatchError: seed, model, optimizer or batch differ, and ``allow_config_change`` is not set.
    """
    changes = _model_changes(meta.get("model"), model_config)
    if meta.get("run_id"):
        saved = meta["config"]
        changes += [f"{k} {saved[k]!r} (this run: {getattr(config, k)!r})" for k in RESUME_KEYS
                    if k in saved and saved[k] != getattr(config, k)]
    if not changes:
        return None
    shown = ", ".join(changes[:8]) + (f" and {len(changes) - 8} more" if len(changes) > 8 else "")
    if config.allow_config_change:
        return f"allow_config_change=true: resuming with settings that differ from the checkpoint's: {shown}"
    raise ResumeMismatchError(
        f"the checkpoint {directory} was trained with {shown}; resume with the checkpoint's settings (zinfjax ckpt "
        f"info {os.path.dirname(directory)} shows them), or set allow_config_change=true to resume with this run's")


def _model_changes(saved: dict | None, model_config) -> list[str]:
    if not saved or model_config is None:
        return []
    now = json.loads(json.dumps(dataclasses.asdict(model_config)))  # as the checkpoint's JSON holds it: lists
    return [f"model.{k} {saved[k]!r} (this run: {now[k]!r})" for k in now if k in saved and saved[k] != now[k]]


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:10])) + (f", ... ({len(steps)} in all)" if len(steps) > 10 else "")
