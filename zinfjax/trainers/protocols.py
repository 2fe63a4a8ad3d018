"""What the training loop asks of a trainer: the next batch, a step, and, for the engine, its engine and restore."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from zinfjax.checkpoint import CheckpointSource
    from zinfjax.data import Batches
    from zinfjax.engine import Engine


@runtime_checkable
class Trainer(Protocol):
    """A trainer `zinfjax.training.run` drives: `ReferenceTrainer` (in memory) or `EngineTrainer` (streaming).

    ``engine`` is the streaming engine (None in memory); ``restored`` the checkpoint a run resumed from (None for
    a fresh start).

    Example:
        >>> from zinfjax import Config
        >>> from zinfjax.trainers.build import build_trainer
        >>> model, trainer = build_trainer(Config(model="gpt2-tiny", seq_len=16, mesh="data:1"))   # in memory
        >>> isinstance(trainer, Trainer), trainer.engine is None
        (True, True)
    """

    engine: Engine | None
    restored: CheckpointSource | None

    def next_batch(self, batches: Batches):
        """The next global batch, placed as ``step`` takes it."""

    def step(self, batch) -> dict:
        """One optimizer step; returns its metrics (``loss`` at least)."""

    def close(self) -> None:
        """Lets go of what the trainer holds (the engine's stores and threads)."""
