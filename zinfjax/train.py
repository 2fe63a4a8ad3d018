"""The training loop behind ``zinfjax train``: data, steps, progress bar, JSON log and loss curve.

Under `zinfjax launch` it runs as one of several processes (docs/sharding.md): each builds its
rows of every batch, streams its state through its own ``nvme_path/process_<i>``, and process 0
alone writes the log and shows progress.

Example:
    >>> log = run(Config(model="gpt2-tiny", steps=50, log="runs/demo.json"))
    >>> log["steps"][-1]["loss"] < log["steps"][0]["loss"]
    True
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import optax
from tqdm import tqdm

from zinfjax import models
from zinfjax.config import TIER_KEYS, Config
from zinfjax.data import Batches, check_vocab, load_tokens
from zinfjax.distributed import initialize_from_env, is_main_process, process_nvme_path
from zinfjax.engine import Engine
from zinfjax.engine.engine import COMPUTE_DTYPES
from zinfjax.optim import make_optimizer
from zinfjax.plots import loss_curve
from zinfjax.reference import init_state, make_step
from zinfjax.sharding import batch_sharding, check_batch, make_mesh
from zinfjax.units import format_bytes


class ReferenceTrainer:
    """The in-memory reference trainer behind a ``step(batch) -> metrics`` interface."""

    def __init__(self, config: Config, model, mesh):
        self.tx = make_optimizer(config)
        self.mesh = mesh
        self.params, self.opt_state = init_state(model, self.tx, mesh, config.seed, config.seq_len)
        self._step = make_step(model.layers(), self.tx, mesh, config.grad_accum)

    def next_batch(self, batches: Batches) -> jax.Array:
        return global_batch(batches, batch_sharding(self.mesh))

    def step(self, batch) -> dict:
        batch = jax.device_put(batch, batch_sharding(self.mesh))
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, batch)
        return {"loss": float(loss)}


class EngineTrainer:
    """The streaming engine behind the same ``step(batch) -> metrics`` interface.

    With ``config.resume`` it starts from the newest complete checkpoint in ``config.save_dir``
    (``self.restored``: its directory), else from the initial parameters.
    """

    def __init__(self, config: Config, model, mesh):
        self.restored = None
        source = self._checkpoint(config, model, mesh) if config.resume else None
        if source is None:
            source, _ = init_state(model, optax.identity(), mesh, config.seed, config.seq_len)
        tx = make_optimizer(config.replace(grad_clip=0.0))  # the engine clips from config.grad_clip itself
        self.engine = Engine(model.layers(), source, tx, config, mesh, (config.batch_size, config.seq_len + 1))

    def _checkpoint(self, config: Config, model, mesh):
        from zinfjax.checkpoint import CheckpointSource, complete_steps

        if not complete_steps(config.save_dir):
            return None
        abstract = jax.eval_shape(lambda: init_state(model, optax.identity(), mesh, config.seed, config.seq_len)[0])
        source = CheckpointSource(config.save_dir, abstract)
        self.restored = source
        return source

    def next_batch(self, batches: Batches):
        # The engine places a host batch itself; every process builds the same one, as batch n
        # depends only on (seed, n).
        return next(batches)

    def step(self, batch) -> dict:
        return self.engine.train_step(batch)

    def close(self) -> None:
        self.engine.close()


def global_batch(batches: Batches, sharding) -> jax.Array:
    """The next batch as one global array; each process reads only the rows its devices hold.

    Example:
        >>> global_batch(Batches(tokens, 8, 64), batch_sharding(mesh)).shape
        (8, 65)
    """
    n = batches.position
    batches.position += 1
    shape = (batches.batch_size, batches.seq_len + 1)
    return jax.make_array_from_callback(shape, sharding, lambda index: batches.batch(n, index[0])[:, index[1]])


def uses_engine(config: Config) -> bool:
    """The reference trainer serves a plain in-memory run; anything offloaded, sharded or checkpointed streams."""
    return config.stage > 0 or bool(config.save_dir) or any(getattr(config, k) != "device" for k in TIER_KEYS)


def build_trainer(config: Config):
    """The model, mesh and trainer a config describes."""
    model_config = models.ModelConfig.resolve(config.model)
    model = models.build(model_config, COMPUTE_DTYPES[config.precision])
    mesh = make_mesh(config.mesh_axes())
    check_batch(config.batch_size, mesh, config.grad_accum)
    if config.seq_len > model_config.max_seq_len:
        from zinfjax.errors import ConfigError

        raise ConfigError(f"seq_len={config.seq_len} exceeds the model's context of {model_config.max_seq_len}")
    trainer = EngineTrainer if uses_engine(config) else ReferenceTrainer
    return model, trainer(config, model, mesh)


def run(config: Config, progress: bool = True, trace: str | None = None) -> dict:
    """Trains for ``config.steps`` steps; writes the JSON log and loss curve when ``config.log`` is set.

    Started by `zinfjax launch`, it first joins the other processes (`initialize_from_env`). The
    log's ``init_s`` is the time from this call to the first step's start (model, state, engine).
    """
    started = time.perf_counter()
    initialize_from_env()
    main = is_main_process()
    model, trainer = build_trainer(config.replace(nvme_path=process_nvme_path(config.nvme_path)))
    tracer = _attach_tracer(trainer, trace if main else None)
    tokens = load_tokens(config.data)
    check_vocab(tokens, model.config.vocab_size, config.data)
    batches = Batches(tokens, config.batch_size, config.seq_len, config.seed)
    log = {"config": config.to_dict(), "processes": jax.process_count(), "devices": jax.device_count(), "steps": []}
    first = _start(trainer, batches, log, main)
    saver = Saver(config, model.config, trainer) if config.save_dir else None
    bar = tqdm(range(first, config.steps + 1), disable=not (progress and main), unit="step", dynamic_ncols=True,
               initial=first - 1, total=config.steps)
    log["init_s"] = time.perf_counter() - started
    try:
        for step in bar:
            start = time.perf_counter()
            metrics = trainer.step(trainer.next_batch(batches))
            seconds = time.perf_counter() - start
            record = {"step": step, **metrics, "tokens_per_s": config.batch_size * config.seq_len / seconds}
            log["steps"].append(record)
            bar.set_postfix_str(progress_text(record), refresh=False)
            if saver:
                saver.after_step(step, batches.position, last=step == config.steps)
        if saver:
            saver.close()
    finally:
        if tracer is not None:
            tracer.detach()
            tracer.save(trace)
        getattr(trainer, "close", lambda: None)()
    if config.log and main:
        write_log(log, config.log)
    return log


def _start(trainer, batches: Batches, log: dict, main: bool) -> int:
    """The first step to run: 1, or one past a restored checkpoint (whose data position it takes)."""
    engine = getattr(trainer, "engine", None)
    interrupted = engine.interrupted_step if engine is not None else None
    restored = getattr(trainer, "restored", None)
    notes = []
    if interrupted is not None:
        notes.append(f"the working state in {trainer.engine.config.nvme_path} was cut short during step "
                     f"{interrupted} and is rebuilt")
    if restored is not None:
        batches.position = restored.data_position
        notes.append(f"resuming from checkpoint {restored.directory} (step {restored.step})")
        log["resumed_from"] = {"directory": restored.directory, "step": restored.step}
    elif getattr(trainer, "engine", None) is not None and trainer.engine.config.resume:
        notes.append(f"no checkpoint in {trainer.engine.config.save_dir} yet: starting from step 0")
    if notes and main:
        print("zinfjax: " + "; ".join(notes), file=sys.stderr)
    return 1 + (restored.step if restored is not None else 0)


class Saver:
    """Checkpoints of a ``zinfjax train`` run: every ``save_every`` steps and after the last one.

    A failed save is reported and training goes on; the previous checkpoints are intact.
    """

    def __init__(self, config: Config, model_config, trainer):
        from zinfjax.checkpoint import CheckpointManager

        self.every, self.trainer = config.save_every, trainer
        self.manager = CheckpointManager(config.save_dir, keep=config.keep_checkpoints, config=config,
                                         model=model_config)

    def after_step(self, step: int, data_position: int, last: bool) -> None:
        from zinfjax.checkpoint import CheckpointSaveError

        if last or (self.every and step % self.every == 0):
            try:
                self.manager.save(self.trainer.engine, step=step, data_position=data_position)
            except CheckpointSaveError as e:
                self._report(e)
            self._report(self.manager.last_error)

    def close(self) -> None:
        self._report(self.manager.wait(raise_error=False))
        self.manager.close()

    @staticmethod
    def _report(error) -> None:
        if error is not None and is_main_process():
            print(f"zinfjax: warning: {error}", file=sys.stderr)


def _attach_tracer(trainer, path: str | None):
    if path is None:
        return None
    if not isinstance(trainer, EngineTrainer):
        from zinfjax.errors import ConfigError

        raise ConfigError("--trace records the streaming engine; offload a tier (e.g. --set params=host)")
    from zinfjax.engine.trace import Tracer

    tracer = Tracer()
    tracer.attach(trainer.engine)
    return tracer


def progress_text(record: dict) -> str:
    """Loss, tokens/s, and for a streamed step the I/O stall, overlap and bytes moved per tier."""
    parts = [f"loss={record['loss']:.4f}", f"tok/s={record['tokens_per_s']:.0f}"]
    if "stall_s" in record:
        parts += [f"stall={record['stall_s']:.2f}s", f"overlap={record['overlap']:.0%}"]
    for tier in ("host", "nvme"):
        moved = record.get(f"read_bytes_{tier}", 0) + record.get(f"write_bytes_{tier}", 0)
        if moved:
            parts.append(f"{tier}={format_bytes(moved)}")
    return " ".join(parts)


def write_log(log: dict, path: str) -> None:
    """Writes the JSON log and, beside it, the loss curve PNG."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(log, f, indent=1)
    loss_curve(log, os.path.splitext(path)[0] + ".png")
