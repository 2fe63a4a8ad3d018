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

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from zinfjax import allocator, models, rss
from zinfjax.byte_sizes import format_bytes
from zinfjax.checkpoint import CheckpointManager, CheckpointSaveError, CheckpointSource
from zinfjax.checkpoint.resume import plan_start, resume_directory
from zinfjax.config import Config
from zinfjax.data import Batches, check_vocab, load_tokens
from zinfjax.distributed import initialize_from_env, is_main_process, process_nvme_path
from zinfjax.engine import Engine, update_plan
from zinfjax.engine.trace import Tracer
from zinfjax.errors import ConfigError, UserError
from zinfjax.in_memory import init_state, make_step
from zinfjax.inference.params import resolve_model
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.nonfinite import LossWatch
from zinfjax.optim import make_optimizer, make_schedule
from zinfjax.plots import loss_curve
from zinfjax.preflight import check_writable_file
from zinfjax.program import InitSource, program_for
from zinfjax.sharding import batch_sharding, check_batch, make_mesh
from zinfjax.vocabulary import COMPUTE_DTYPES, TIER_KEYS


class ReferenceTrainer:
    """The in-memory reference trainer behind a ``step(batch) -> metrics`` interface.

    Its step keeps each block's matrix products for the backward and recomputes the rest
    (``StackedLM.save_products``), as the engine's saved residuals do: the plain loop's arithmetic, up to
    the rounding of the recomputed values, without stacking every intermediate of every layer.
    """

    def __init__(self, config: Config, model, mesh):
        self.tx = make_optimizer(config)
        self.mesh = mesh
        self.params, self.opt_state = init_state(lm_init(model), self.tx, mesh, config.seed)
        self.loss = lm_loss(model.clone(save_products=True))
        self._step = make_step(self.loss, self.tx, mesh, config.grad_accum)

    def next_batch(self, batches: Batches) -> jax.Array:
        return global_batch(batches, batch_sharding(self.mesh))

    def step(self, batch) -> dict:
        batch = jax.device_put(batch, batch_sharding(self.mesh))
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, batch)
        return {"loss": float(loss)}


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
    elif callable(source) and not hasattr(source, "params"):
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
    model_config = resolve_model(config.model)
    model = models.build(model_config, COMPUTE_DTYPES[config.precision])
    mesh = make_mesh(config.mesh_axes())
    check_batch(config.batch_size, mesh, config.grad_accum)
    if config.seq_len > model_config.max_seq_len:
        raise ConfigError(f"seq_len={config.seq_len} exceeds the model's context of {model_config.max_seq_len}")
    trainer = EngineTrainer if uses_engine(config) else ReferenceTrainer
    return model, trainer(config, model, mesh)


def run(config: Config, progress: bool = True, trace: str | None = None) -> dict:
    """Trains for ``config.steps`` steps; writes the JSON log and loss curve when ``config.log`` is set.

    Started by `zinfjax launch`, it first joins the other processes (`initialize_from_env`). Before
    building the model it checks the log path, the data and the save_dir (`plan_start`); a run
    whose loss stays non-finite, or whose final checkpoint fails, writes its log and raises. The
    log's ``init_s`` is the time from this call to the first step's start (model, state, engine).
    """
    started = time.perf_counter()
    initialize_from_env()
    main = is_main_process()
    config = config.with_batch_for(make_mesh(config.mesh_axes()).shape["data"])  # DeepSpeed's micro-batch
    if config.tiers == "auto":
        config = auto_tiers(config, main)
    if config.log and main:
        check_writable_file(config.log, "log")
    model_config = resolve_model(config.model)
    tokens = load_tokens(config.data)
    check_vocab(tokens, model_config.vocab_size, config.data)
    batches = Batches(tokens, config.batch_size, config.seq_len, config.seed)
    plan = plan_start(config, model_config)
    if plan.notes and main:
        print("zinfjax: " + "; ".join(plan.notes), file=sys.stderr)
    config = plan.config
    model, trainer = build_trainer(config.replace(nvme_path=process_nvme_path(config.nvme_path)))
    tracer = _attach_tracer(trainer, trace if main else None)
    log = {"config": config.to_dict(), "processes": jax.process_count(), "devices": jax.device_count(),
           "init_s": time.perf_counter() - started, "init_peak_rss_bytes": rss.peak_bytes(),
           "malloc_huge_pages": allocator.huge_pages(), "steps": []}
    first = _start(trainer, batches, log, main)
    schedule = make_schedule(config)
    if config.warmup_steps > config.steps and main:
        print(f"zinfjax: warning: warmup_steps={config.warmup_steps} is longer than the run (steps={config.steps}): "
              "the learning rate never reaches lr", file=sys.stderr)
    if getattr(trainer, "engine", None) is not None:
        log["budget"] = dataclasses.asdict(trainer.engine.budget)
        log["update_parts"] = {g: len(p) for g, p in trainer.engine.parts.items()}  # layers updated in parts
        log["update_on"] = trainer.engine.update_on  # where the optimizer update ran (update_on=auto decides)
        log["host_memory_kind"] = trainer.engine.host_kind
        log["recompute"] = not trainer.engine.saves_residuals  # whether each backward reruns its forward
        log["residual_bytes_bound"] = trainer.engine.residual_bytes  # what recompute=auto counted them at, at most
        log["reused_layers"] = len(trainer.engine.reuse)  # layers whose parameters the backward took from the forward
        # Layers whose update handed the next forward its copy (`Engine.handoff`); the key keeps its first name,
        # "carried", so that logs stay comparable.
        log["carried_layers"] = len(trainer.engine.handoff)
        log["staging_memory"] = trainer.engine.stores.pool.stats()["memory"]  # NVMe staging: pinned_host or pageable
        if trainer.engine.host_kind_fallback:
            log["host_memory_fallback"] = trainer.engine.host_kind_fallback
    saver = Saver(config, model.config, trainer, plan.run_id, first - 1) if config.save_dir else None
    watch = LossWatch(config.max_nonfinite_steps, config.lr)
    bar = tqdm(range(first, config.steps + 1), disable=not (progress and main), unit="step", dynamic_ncols=True,
               initial=first - 1, total=config.steps)
    stopped = None
    log["init_s"] = time.perf_counter() - started  # through the restore, if any
    try:
        for step in bar:
            rss.reset_peak()
            start = time.perf_counter()
            metrics = trainer.step(trainer.next_batch(batches))
            seconds = time.perf_counter() - start
            record = {"step": step, **metrics, "tokens_per_s": config.batch_size * config.seq_len / seconds,
                      "lr": float(schedule(step - 1)) if callable(schedule) else schedule,
                      "peak_rss_bytes": rss.peak_bytes(), **device_memory()}
            log["steps"].append(record)
            bar.set_postfix_str(progress_text(record), refresh=False)
            finite = watch.after_step(step, metrics["loss"])
            if saver:
                saver.after_step(step, batches.position, last=step == config.steps, finite=finite)
            if watch.exhausted or (watch.failing and step == config.steps):
                stopped = step
                break
        failure = saver.close(finished=stopped is None) if saver else None
        if stopped is not None:
            failure = watch.error(stopped, *(saver.good_and_doubtful() if saver else (None, None)))
    finally:
        if tracer is not None:
            tracer.detach()
            tracer.save(trace)
        getattr(trainer, "close", lambda: None)()
    if failure is not None:
        log["error"] = str(failure)
    if config.log and main:
        write_log(log, config.log)
    if failure is not None:
        raise failure
    return log


def auto_tiers(config: Config, main: bool = True) -> Config:
    """``tiers=auto``: the tier keys from `zinfjax.plan` (probes unless ``ZINFJAX_PLAN_PROBE=0``)."""
    from zinfjax.plan import resolve_auto

    probe = os.environ.get("ZINFJAX_PLAN_PROBE", "1") != "0"
    config, plan = resolve_auto(config, probe=probe)
    if main:
        chosen = " ".join(f"{k}={getattr(config, k)}" for k in TIER_KEYS)
        print(f"zinfjax: tiers=auto: {chosen} (predicted {plan['recommended']['step_s']:.3f} s/step; "
              "zinfjax plan shows the alternatives)", file=sys.stderr)
    return config


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

    A failed save is reported and training goes on; the previous checkpoints are intact. A failed
    final save fails the run (`close` returns the error). A step whose loss is not finite is never
    saved, and pruning keeps the newest checkpoint that a finite loss has vouched for even beyond
    ``keep_checkpoints`` (see `zinfjax.nonfinite`), until the run ends.
    """

    def __init__(self, config: Config, model_config, trainer, run_id: str | None = None, start: int = 0):
        self.every, self.trainer = config.save_every, trainer
        self.manager = CheckpointManager(config.save_dir, keep=config.keep_checkpoints, config=config,
                                         model=model_config, run_id=run_id)
        self.saved = [start]  # this run's checkpoints, and the one it resumed from (0: none, or a converted one)
        self.final: int | None = None
        self.final_error = None

    def after_step(self, step: int, data_position: int, last: bool, finite: bool = True) -> None:
        if finite:  # this loss came from the parameters of step - 1: the checkpoints up to there are good
            self.manager.protect = max((s for s in self.saved if s < step), default=None)
        if not finite or not (last or (self.every and step % self.every == 0)):
            return
        self.final = step if last else None
        try:
            self.manager.save(self.trainer.engine, step=step, data_position=data_position)
            self.saved.append(step)
        except CheckpointSaveError as e:
            self._report_or_keep(e)
        self._report_or_keep(self.manager.last_error)

    def good_and_doubtful(self) -> tuple[int | None, list[int]]:
        """The newest checkpoint a finite loss vouched for, and the ones saved after it (on disk)."""
        on_disk = set(self.manager.steps())
        good = self.manager.protect if self.manager.protect in on_disk else None
        return good, [s for s in self.saved if s in on_disk and (good is None or s > good)]

    def close(self, finished: bool):
        """Waits for the last save; returns the run's error if the final checkpoint failed, else None."""
        self._report_or_keep(self.manager.wait(raise_error=False))
        if finished and self.final_error is None:
            self.manager.protect = None
            self.manager.prune()  # the run ended well: back to keep_checkpoints
        self.manager.close()
        if self.final_error is None:
            return None
        steps = self.manager.steps()
        newest = (f"the newest checkpoint is step {steps[-1]} (resume=true continues from it)" if steps
                  else "no checkpoint exists")
        reason = getattr(self.final_error, "reason", str(self.final_error))
        return CheckpointSaveError(f"the final checkpoint (step {self.final}) was not saved: {reason}; {newest}")

    def _report_or_keep(self, error) -> None:
        """A failed save of the last step fails the run; any other is a warning."""
        if error is None:
            return
        if self.final is not None and getattr(error, "step", None) == self.final:
            self.final_error = error
        elif is_main_process():
            print(f"zinfjax: warning: {error}", file=sys.stderr)


def _attach_tracer(trainer, path: str | None):
    if path is None:
        return None
    if not isinstance(trainer, EngineTrainer):
        raise ConfigError("--trace records the streaming engine; offload a tier (e.g. --set params=host)")
    tracer = Tracer()
    tracer.attach(trainer.engine)
    return tracer


def device_memory() -> dict:
    """The first local device's peak and current memory in use, where the platform reports them (GPU, TPU).

    Example:
        >>> device_memory()   # on the CPU backend: nothing to report
        {}
    """
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return {}
    return {"device_peak_bytes": stats["peak_bytes_in_use"], "device_bytes_in_use": stats.get("bytes_in_use", 0)}


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
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(log, f, indent=1)
        loss_curve(log, os.path.splitext(path)[0] + ".png")
    except OSError as e:
        raise UserError(f"the log {path} could not be written after training: {e.strerror or e}") from e
