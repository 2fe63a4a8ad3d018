"""Which checkpoint a ``zinfjax train`` run starts from, decided before any model is built.

- ``resume=false``: none; the save_dir must hold no other run's checkpoints (`identity.check_fresh`).
- ``resume=true``: the newest checkpoint that verifies (`verify.verify_checkpoint`: every chunk's
  crc32c); newer ones that do not are skipped, and the run says which and why.
- ``resume=STEP``: that checkpoint, which must verify.

Steps newer than the one resumed from (the skipped ones, or those after ``STEP``) are moved aside to
``<save_dir>/.superseded-<time>/``: the resumed run saves its own checkpoints under those numbers,
and pruning must never weigh another branch's checkpoints against this run's.

Example:
    >>> import numpy as np, tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.checkpoint.writer import write_params
    >>> from zinfjax.models import ModelConfig
    >>> model, save_dir = ModelConfig.named("gpt2-tiny"), tempfile.mkdtemp()
    >>> config = Config(save_dir=save_dir, resume=True)
    >>> for step in (4, 6):
    ...     path = write_params(save_dir, {"blocks": {"fc": {"kernel": np.ones((3, 4, 4), np.float32)}}}, step=step,
    ...                         config=config, model=model)
    >>> with open(f"{path}/params/blocks.fc.kernel/c/2/0/0", "r+b") as chunk:   # a bit flips in step 6's layer 2
    ...     _ = chunk.write(bytes([1]))
    >>> start = choose_start(config, model)
    >>> start.step, start.notes
    (4, ['skipped step 6: corrupt (params/blocks.fc.kernel: chunk c/2/0/0: crc32c mismatch)', ...])
"""

from __future__ import annotations

import dataclasses
import os

import jax

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint import identity
from zinfjax.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError
from zinfjax.checkpoint.verify import Checked, verify_checkpoint


@dataclasses.dataclass
class RunStart:
    """Where a run starts: ``config`` with ``resume`` set to the chosen step (or as it was, with none)."""

    config: object  # zinfjax.config.Config
    step: int | None = None
    run_id: str | None = None  # the run the checkpoint belongs to, which this run continues
    notes: list[str] = dataclasses.field(default_factory=list)


def choose_start(config, model_config) -> RunStart:
    """Checks the save_dir against the run and chooses its checkpoint; see the module docstring.

    Raises:
        SaveDirInUseError, ResumeMismatchError, CheckpointNotFoundError, CheckpointCorruptError: one line each,
            saying what to change.
    """
    if not config.save_dir:
        return RunStart(config)
    if not config.resuming:
        note = identity.check_fresh(config)
        return RunStart(config, notes=[note] if note else [])
    save_dir = os.path.abspath(config.save_dir)
    if config.resume_step is not None:
        step, skipped = _asked(save_dir, config.resume_step), []
    else:
        step, skipped = _newest_complete(save_dir)
    if step is None:
        return RunStart(config)
    directory = fmt.step_dir(save_dir, step)
    meta = fmt.read_meta(directory)
    notes = [f"skipped {c.describe()}" for c in skipped]
    note = identity.check_resume(meta, directory, config, model_config)
    notes += [note] if note else []
    newer = [s for s in fmt.step_names(save_dir) if s > step]
    if newer and jax.process_index() == 0:
        aside = identity.set_aside(save_dir, newer, "superseded")
        notes.append(f"moved step{'s' if len(newer) > 1 else ''} {', '.join(map(str, newer))} (newer than step {step}) "
                     f"aside to {aside}, so that this run's checkpoints do not mix with them")
    return RunStart(config.replace(resume=step), step, meta.get("run_id"), notes)


def _newest_complete(save_dir: str) -> tuple[int | None, list[Checked]]:
    skipped = []
    for step in reversed(fmt.step_names(save_dir)):
        checked = verify_checkpoint(fmt.step_dir(save_dir, step))
        if checked.complete:
            return step, skipped
        skipped.append(checked)
    if skipped:
        raise CheckpointNotFoundError(
            f"resume=true: no complete checkpoint in {save_dir} ({'; '.join(c.describe() for c in skipped)}); "
            "start a new run there with overwrite=true instead of resume (they are moved aside), or choose another "
            "save_dir")
    return None, []


def _asked(save_dir: str, step: int) -> int:
    steps = fmt.step_names(save_dir)
    if step not in steps:
        have = f"its steps are {', '.join(map(str, steps))}" if steps else "it holds no checkpoint"
        raise CheckpointNotFoundError(f"resume={step}: {save_dir} has no checkpoint of step {step}; {have}")
    checked = verify_checkpoint(fmt.step_dir(save_dir, step))
    if not checked.complete:
        raise CheckpointCorruptError(f"resume={step}: {checked.describe()}; choose another step (zinfjax ckpt info "
                                     f"{save_dir} --verify lists the complete ones)")
    return step


def resume_directory(config) -> str | None:
    """The checkpoint a resuming `EngineTrainer` restores: the step `choose_start` chose, or the newest verified."""
    if config.resume_step is None:
        step = _newest_complete(os.path.abspath(config.save_dir))[0]
        return None if step is None else fmt.step_dir(os.path.abspath(config.save_dir), step)
    return fmt.step_dir(os.path.abspath(config.save_dir), config.resume_step)
