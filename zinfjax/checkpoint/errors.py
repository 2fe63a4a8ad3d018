"""Checkpoint errors: each names the problem and the fix."""

from __future__ import annotations

from zinfjax.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be written or read."""


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, unwritable directory); the previous checkpoints are intact."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint where one was asked for."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint holds another model or optimizer: its leaves differ from the run's."""


class CheckpointCorruptError(CheckpointError):
    """A chunk of the checkpoint failed its crc32c check or is missing."""
