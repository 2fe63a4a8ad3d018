"""Checkpoints: sharded, asynchronous, atomic and reshardable, straight from every tier.

See docs/checkpoint.md.

Example:
    >>> manager = CheckpointManager("runs/ckpt", keep=3)
    >>> manager.save(state)                                   # async; training goes on
    >>> state = zinfjax.wrap(train_state, other_config, restore="runs/ckpt")   # any mesh, stage, tiers
"""

from zinfjax.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)
from zinfjax.checkpoint.format import complete_steps, read_meta
from zinfjax.checkpoint.manager import CheckpointManager, latest_checkpoint
from zinfjax.checkpoint.restore import CheckpointSource
from zinfjax.checkpoint.writer import CheckpointWriter, expected_leaves

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointManager", "CheckpointMismatchError",
    "CheckpointNotFoundError", "CheckpointSaveError", "CheckpointSource", "CheckpointWriter", "complete_steps",
    "expected_leaves", "latest_checkpoint", "read_meta",
]
