"""The streaming engine as ``zinfjax train``'s trainer: a reference language model's program, its engine, and the
trainer that starts it from a fresh initialisation or the newest checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zinfjax import models
from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.checkpoint import CheckpointSource
from zinfjax.checkpoint.model import start_checkpoint
from zinfjax.checkpoint.resume import resume_directory
from zinfjax.config import Config
from zinfjax.data import Batches
from zinfjax.engine import Engine, Source, update_plan
from zinfjax.engine.budget import MemoryBudgetError
from zinfjax.engine.engine import prepare, streamed_program
from zinfjax.models.configs import ModelConfig, tile_counts
from zinfjax.models.stacked import lm_init, lm_loss, takes_rng
from zinfjax.program import InitSource, program_for
from zinfjax.sections import EngineSettings
from zinfjax.trainers.optimizers import make_optimizer


def lm_program(model, config: Config, tx, mesh=None, settings: EngineSettings | None = None):
    """The program (and update plan) of a reference language model on ``(batch_size, seq_len + 1)`` tokens, as the
    engine streams it on ``mesh`` (`zinfjax.engine.engine.streamed_program`) under ``settings`` (default:
    ``config``'s, `Config.engine_settings`); without a mesh, tile by tile."""
    batch = jax.ShapeDtypeStruct((config.batch_size // config.grad_accum, config.seq_len + 1), jnp.int32)
    compute = COMPUTE_DTYPES[config.precision]
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute),
                        jax.eval_shape(lm_init(model), jax.random.key(0)))
    def make(nest: bool):
        return program_for(lm_loss(model), like, batch, with_rng=takes_rng(model), nest_tiles=nest)

    settings = settings or config.engine_settings()
    program = make(True) if mesh is None else streamed_program(make, tx, settings, mesh, model.partition_rules)
    return program, update_plan(tx, program)


def choose_tiles(model_config: ModelConfig, config: Config, mesh, tx=None) -> ModelConfig:
    """``tiles=auto``: the model with the fewest tiles whose largest operation fits the engine's memory budget (the
    engine's own plan, `zinfjax.engine.engine.prepare`); untiled when it fits untiled.

    Raises:
        MemoryBudgetError: no tile count fits; the message is the finest tiling's, with the budget it needs.
    """
    tx = tx or make_optimizer(config)
    error = None
    for tiles in tile_counts(model_config):
        candidate = model_config.replace(tiles=tiles)
        try:
            fits(candidate, config, mesh, tx)
        except MemoryBudgetError as e:
            error = e
            continue
        return candidate
    raise MemoryBudgetError(f"{error} (with tiles={tiles}, the most this model can be cut into)") from None


def fits(model_config: ModelConfig, config: Config, mesh, tx=None) -> None:
    """Raises `MemoryBudgetError` where the engine could not train ``model_config`` (as tiled) under ``config``'s
    memory budget; opens nothing."""
    tx = tx or make_optimizer(config)
    model = models.build(model_config, COMPUTE_DTYPES[config.precision])
    program, _ = lm_program(model, config, tx, mesh)
    prepare(program, tx, config.engine_settings(), mesh, model.partition_rules)


def lm_engine(model, config: Config, mesh, source=None, tx=None, settings: EngineSettings | None = None) -> Engine:
    """An engine training a reference language model.

    ``source`` is None (initialise layer by layer, bitwise as ``model.init``), a source, or a
    callable ``source(program, plan)`` that makes one. ``settings``: the engine's (default: ``config``'s,
    `Config.engine_settings`), for a caller that asks the engine about other tiers or budgets than the run's.

    Example:
        >>> import tempfile
        >>> from zinfjax.sharding import make_mesh
        >>> config = Config(model="gpt2-tiny", seq_len=16, params="nvme", nvme_path=tempfile.mkdtemp(), mesh="data:1")
        >>> engine = lm_engine(models.build("gpt2-tiny"), config, make_mesh(config.mesh_axes()))
        >>> engine.num_layers, sorted(engine.program.groups)[:2]
        (4, ['s:blocks', 's:embed.wte.embedding'])
        >>> engine.close()
    """
    tx = tx or make_optimizer(config)
    settings = settings or config.engine_settings()
    program, plan = lm_program(model, config, tx, mesh, settings)
    if source is None:
        source = InitSource(program, lm_init(model), jax.random.key(config.seed))
    elif not isinstance(source, Source):  # a callable that makes one
        source = source(program, plan)
    return Engine(program, source, tx, settings, mesh, tp_rules=model.partition_rules)


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
        init = InitSource(program, lm_init(self._model), jax.random.key(config.seed))
        start = start_checkpoint(config.model)  # model=<checkpoint>: its parameters, adapters made afresh
        return init if start is None else CheckpointSource(start, program, plan, start=True, fallback=init)

    def next_batch(self, batches: Batches):
        # The engine places a host batch itself; every process builds the same one, as batch n
        # depends only on (seed, n).
        return next(batches)

    def step(self, batch) -> dict:
        return self.engine.train_step(batch)

    def close(self) -> None:
        self.engine.close()
