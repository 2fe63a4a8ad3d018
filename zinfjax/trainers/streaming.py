"""The streaming engine as ``zinfjax train``'s trainer: a reference language model's program, its engine, and the
trainer that starts it from a fresh initialisation or the newest checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.checkpoint import CheckpointSource
from zinfjax.checkpoint.resume import resume_directory
from zinfjax.config import Config
from zinfjax.data import Batches
from zinfjax.engine import Engine, Source, update_plan
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.program import InitSource, program_for
from zinfjax.trainers.optimizers import make_optimizer


def lm_program(model, config: Config, tx):
    """The program (and update plan) of a reference language model on ``(batch_size, seq_len + 1)`` tokens."""
    batch = jax.ShapeDtypeStruct((config.batch_size // config.grad_accum, config.seq_len + 1), jnp.int32)
    compute = COMPUTE_DTYPES[config.precision]
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute),
                        jax.eval_shape(lm_init(model), jax.random.key(0)))
    program = program_for(lm_loss(model), like, batch)
    return program, update_plan(tx, program)


def lm_engine(model, config: Config, mesh, source=None, tx=None) -> Engine:
    """An engine training a reference language model.

    ``source`` is None (initialise layer by layer, bitwise as ``model.init``), a source, or a
    callable ``source(program, plan)`` that makes one.

    Example:
        >>> engine = lm_engine(models.build("gpt2-tiny"), Config(params="nvme", nvme_path="/nv"), mesh)
    """
    tx = tx or make_optimizer(config)
    program, plan = lm_program(model, config, tx)
    if source is None:
        source = InitSource(program, lm_init(model), jax.random.key(config.seed))
    elif not isinstance(source, Source):  # a callable that makes one
        source = source(program, plan)
    return Engine(program, source, tx, config, mesh, tp_rules=model.partition_rules)


class EngineTrainer:
    """The streaming engine behind the same ``step(batch) -> metrics`` interface.

    The initial parameters are made one layer at a time straight into their tiers (`InitSource`),
    bitwise as the model's own ``init`` makes them. With ``config.resume`` it starts from the newest
    complete checkpoint in ``config.save_dir`` (``self.restored``: its source) instead.
    """

    def __init__(self, config: Config, model, mesh):
        self.restored = None
        self._config, self._model = config, model
        self.engine = lm_engine(model, config, mesh, source=self._source)

    def _source(self, program, plan):
        config = self._config
        directory = resume_directory(config) if config.resuming else None  # run's choice: resume=STEP, else newest
        if directory is not None:
            self.restored = CheckpointSource(directory, program, plan)
            return self.restored
        return InitSource(program, lm_init(self._model), jax.random.key(config.seed))

    def next_batch(self, batches: Batches):
        # The engine places a host batch itself; every process builds the same one, as batch n
        # depends only on (seed, n).
        return next(batches)

    def step(self, batch) -> dict:
        return self.engine.train_step(batch)

    def close(self) -> None:
        self.engine.close()
