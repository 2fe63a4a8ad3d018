"""The trainers ``zinfjax train`` drives, built from a `Config`: the in-memory reference and the streaming engine.

Each is a `Trainer`: ``next_batch(batches)`` and ``step(batch) -> metrics``. This package knows neither the
training loop (`zinfjax.training`) nor the planner (`zinfjax.planning`), which both build on it.
"""

from zinfjax.trainers.build import build_trainer, uses_engine
from zinfjax.trainers.optimizers import make_optimizer, make_schedule
from zinfjax.trainers.protocols import Trainer
from zinfjax.trainers.reference import ReferenceTrainer
from zinfjax.trainers.streaming import EngineTrainer, lm_engine, lm_program

__all__ = ["EngineTrainer", "ReferenceTrainer", "Trainer", "build_trainer", "lm_engine", "lm_program",
           "make_optimizer", "make_schedule", "uses_engine"]
