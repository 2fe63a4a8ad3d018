"""The training loop behind ``zinfjax train``: data, steps, progress bar, JSON log and loss curve.

Under `zinfjax launch` it runs as one of several processes (docs/sharding.md): each builds its
rows of every batch, streams its state through its own ``nvme_path/process_<i>``, and process 0
alone writes the log and shows progress.

Example:
    >>> log = run(Config(model="gpt2-tiny", steps=10, seq_len=16, lr=3e-3, mesh="data:1"), progress=False)
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
from tqdm import tqdm

from zinfjax._util.byte_sizes import format_bytes
from zinfjax._util.choices import TIER_KEYS
from zinfjax.checkpoint import CheckpointManager, CheckpointSaveError
from zinfjax.checkpoint.format import step_dir
from zinfjax.checkpoint.resume import choose_start
from zinfjax.checkpoint.tokenizer import keep_tokenizer, model_tokens
from zinfjax.checkpoint.verify import verify_checkpoint
from zinfjax.config import Config
from zinfjax.data import Batches
from zinfjax.engine.in_place import nbytes as in_place_nbytes
from zinfjax.engine.trace import Tracer
from zinfjax.errors import ConfigError, UserError
from zinfjax.runtime import allocator, rss
from zinfjax.runtime.distributed import initialize_from_env, is_main_process, process_nvme_path
from zinfjax.sharding import make_mesh
from zinfjax.store.errors import LiveStateCorruptError, StoreCorruptionError, StoreIOError
from zinfjax.trainers.build import build_trainer, run_model
from zinfjax.trainers.optimizers import make_schedule
from zinfjax.training.floor import Floor
from zinfjax.training.nonfinite import LossWatch
from zinfjax.training.plots import loss_curve
from zinfjax.training.preflight import check_writable_file
from zinfjax.training.tensorboard import Board, check_writable_dir


def run(config: Config, progress: bool = True, trace: str | None = None) -> dict:
    """Trains for ``config.steps`` steps; writes the JSON log and loss curve when ``config.log`` is set.

    Started by `zinfjax launch`, it first joins the other processes (`initialize_from_env`). Before
    building the model it checks the log path, the data and the save_dir (`choose_start`); a run
    whose loss stays non-finite, or whose final checkpoint fails, writes its log and raises. The
    log's ``init_s`` is the time from this call to the first step's start (model, state, engine).
    """
    started = time.perf_counter()
    initialize_from_env()
    main = is_main_process()
    given = config.with_batch_for(make_mesh(config.mesh_axes()).shape["data"])  # as given, batch settled: checkpointed
    config, model_config, batches, start, data, plan = _prepare(given, main, progress)
    run_config = config.replace(nvme_path=process_nvme_path(config.nvme_path))
    model, trainer = build_trainer(run_config)
    tracer = _attach_tracer(trainer, trace if main else None)
    log = {"config": config.to_dict(), "processes": jax.process_count(), "devices": jax.device_count(),
           "init_s": time.perf_counter() - started, "init_peak_rss_bytes": rss.peak_bytes(),
           "malloc_huge_pages": allocator.huge_pages(), "data": data, "steps": []}
    first = _start(run_config, trainer, batches, log, main)
    if config.warmup_steps > config.steps and main:
        print(f"zinfjax: warning: warmup_steps={config.warmup_steps} is longer than the run (steps={config.steps}): "
              "the learning rate never reaches lr", file=sys.stderr)
    log["tiles"] = model.config.tiles  # the tiles each block's MLP and attention ran in (tiles=auto decides)
    if plan is not None:  # tiers=auto: the placement the plan chose, and the step it predicted
        log["placement"] = {"tiers": plan["recommended"]["tiers"], "predicted_step_s": plan["recommended"]["step_s"],
                            "regime": plan["recommended"].get("regime"), "engine": plan["recommended"].get("engine"),
                            "compute_alone_s": plan["rates"].get("engine_s"),
                            "nvme_step_GBps": plan["rates"].get("nvme_step_GBps"),
                            "baseline_bytes": plan["machine"].get("baseline_bytes"),  # the engine measures its own
                            "other_cpu_cores": plan["rates"].get("other_cpu_cores")}
    if trainer.engine is not None:
        log.update(engine_facts(trainer.engine))
    saver = Saver(given, model.config, trainer, start.run_id, first - 1) if config.save_dir else None
    floor = board = None
    try:
        try:
            floor, board = _reporters(config, trainer, plan, log, main)
            log["init_s"] = time.perf_counter() - started  # through the restore, if any, and the disk probe
            failure = _steps(config, trainer, batches, log, saver, first, progress and main, floor, board)
        finally:
            if board is not None:
                board.close()
            if tracer is not None:
                tracer.detach()
                tracer.save(trace)
            trainer.close()
    except StoreIOError as e:  # the nvme disk failed: say what is safe, after the save in flight ended
        raise StoreIOError(f"{e}; {Saver.last_complete(saver)}") from e
    except StoreCorruptionError as e:  # a bit of the live state changed on the disk or in memory (verify_chunks)
        resume_from = Saver.last_complete(saver, verified=True)
        raise LiveStateCorruptError(f"the run's state on NVMe is damaged: {e}; {resume_from}",
                                    leaf=e.leaf, layer=e.layer) from e
    if failure is not None:
        log["error"] = str(failure)
    if config.log and main:
        write_log(log, config.log)
    if failure is not None:
        raise failure
    return log


def _prepare(config: Config, main: bool, progress: bool = False):
    """The run's config (tiers=auto and resume decided, from ``config`` with its batch settled), model, batches,
    start and what the data is (for the log), each checked before anything is built."""
    plan = None
    if config.tiers_auto:
        config, plan = auto_tiers(config, main)
    if config.log and main:
        check_writable_file(config.log, "log")
    if config.tensorboard_dir and main:
        check_writable_dir(config.tensorboard_dir, "tensorboard_dir")
    config, model_config = run_model(config)
    tokens, tokenizer = model_tokens(config.data, config.model, model_config.vocab_size, config.tokenizer,
                                     config.data_field, progress=progress and main)
    batches = Batches(tokens, config.batch_size, config.seq_len, config.seed)
    # What the model is fed: the tokenizer, and the memory-mapped token file (zinfjax.data.corpus) if there is one.
    data = {"tokenizer": tokenizer, "tokens": len(tokens), "token_file": getattr(tokens, "filename", None)}
    start = choose_start(config, model_config)
    if start.notes and main:
        print("zinfjax: " + "; ".join(start.notes), file=sys.stderr)
    return start.config, model_config, batches, start, data, plan


def _reporters(config: Config, trainer, plan: dict | None, log: dict, main: bool):
    """Process 0's disk floor (a run with state on nvme: the disk probed now) and TensorBoard writer, or Nones."""
    floor = None
    if main and trainer.engine is not None and config.uses_nvme:
        floor = Floor.for_run(process_nvme_path(config.nvme_path), plan)
        log.update(floor.log_facts())
        if not floor.ok:
            print(f"zinfjax: note: {floor.disk['note']}", file=sys.stderr)
    board = Board(config.tensorboard_dir) if config.tensorboard_dir and main else None
    return floor, board


def engine_facts(engine) -> dict:
    """What the log records of the engine's choices: its budget, parts, update place, residuals, reuse."""
    facts = {
        "budget": dataclasses.asdict(engine.budget),
        "streamed_tiles": engine.tiles,  # the tiles a layer was streamed in (stream_tiles=auto decides); 1: whole
        "largest_operation_bytes": engine.largest_operation_bytes,  # what the largest operation reads
        "update_parts": {g: len(p) for g, p in engine.parts.items()},  # layers updated in parts
        "update_on": engine.update_on,  # where the optimizer update ran (update_on=auto decides)
        "host_memory_kind": engine.host_kind,
        "recompute": not engine.saves_residuals,  # whether each backward reruns its forward
        "residual_bytes_bound": engine.residual_bytes,  # what recompute=auto counted them at, at most
        "reused_layers": len(engine.reuse),  # layers whose parameters the backward took from the forward
        # Layers whose update handed the next forward its copy (`Engine.handoff`); the key keeps its first name,
        # "carried", so that logs stay comparable.
        "carried_layers": len(engine.handoff),
        "staging_memory": engine.stores.pool.stats()["memory"],  # NVMe staging: pinned_host or pageable
    }
    if engine.host_kind_fallback:
        facts["host_memory_fallback"] = engine.host_kind_fallback
    frozen = engine.update_plan.frozen
    if frozen:  # what is frozen, where the base is read from, and whether it was copied into nvme_path
        facts["frozen"] = base_facts(engine)
    return facts


def base_facts(engine) -> dict:
    """The frozen leaves' bytes, and the base they are read from: in place, or copied into the run's stores."""
    program, frozen = engine.program, engine.update_plan.frozen
    placed = {p for paths in engine.in_place.values() for p in paths}
    in_place = [leaf.index for leaf in program.leaves if leaf.path in placed]
    out = {"leaves": len(frozen), "trainable_leaves": len(program.leaves) - len(frozen),
           "frozen_bytes": in_place_nbytes(program, frozen),
           "trainable_bytes": in_place_nbytes(program, set(range(len(program.leaves))) - frozen)}
    if engine.base:
        out["base"] = dict(engine.base)
        out["base"]["in_place_bytes"] = in_place_nbytes(program, in_place)
        out["base"]["copied_bytes"] = in_place_nbytes(program, engine.base_leaves - set(in_place))
    return out


def _steps(config: Config, trainer, batches: Batches, log: dict, saver, first: int, progress: bool,
           floor: Floor | None = None, board: Board | None = None):
    """Steps ``first`` to ``config.steps``, each recorded in ``log`` (with its disk floor, and on TensorBoard,
    where given); returns the run's failure, or None."""
    schedule = make_schedule(config)
    watch = LossWatch(config.max_nonfinite_steps, config.lr)
    bar = tqdm(range(first, config.steps + 1), disable=not progress, unit="step", dynamic_ncols=True,
               initial=first - 1, total=config.steps)
    stopped = None
    for step in bar:
        rss.reset_peak()
        start = time.perf_counter()
        metrics = trainer.step(trainer.next_batch(batches))
        seconds = time.perf_counter() - start
        record = {"step": step, "step_s": seconds, **metrics,  # the engine's own step_s waits for its last write
                  "tokens_per_s": config.batch_size * config.seq_len / seconds,
                  "lr": float(schedule(step - 1)) if callable(schedule) else schedule,
                  "peak_rss_bytes": rss.peak_bytes(), **device_memory()}
        if floor is not None:
            record.update(floor.fields(record))
        log["steps"].append(record)
        if board is not None:
            board.write(record)
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
    return failure


def auto_tiers(config: Config, main: bool = True) -> tuple[Config, dict]:
    """``tiers=auto``: the tier keys from `zinfjax.planning.recommend` (probes unless ``ZINFJAX_PLAN_PROBE=0``), and
    the plan they come from."""
    from zinfjax.planning.recommend import busy_note, resolve_auto

    probe = os.environ.get("ZINFJAX_PLAN_PROBE", "1") != "0"
    config, plan = resolve_auto(config, probe=probe, isolated=True)
    if main:
        chosen = " ".join(f"{k}={getattr(config, k)}" for k in TIER_KEYS)
        print(f"zinfjax: tiers=auto: {chosen} (predicted {plan['recommended']['step_s']:.3f} s/step; "
              "zinfjax plan shows the alternatives)", file=sys.stderr)
        busy = busy_note(plan["rates"])
        if busy:
            print(f"zinfjax: warning: {busy}", file=sys.stderr)
    return config, plan


def _start(config: Config, trainer, batches: Batches, log: dict, main: bool) -> int:
    """The first step to run: 1, or one past a restored checkpoint (whose data position it takes); ``config``: the
    trainer's."""
    engine, restored = trainer.engine, trainer.restored
    interrupted = engine.interrupted_step if engine is not None else None
    notes = []
    if interrupted is not None:
        notes.append(f"the working state in {config.nvme_path} was cut short during step "
                     f"{interrupted} and is rebuilt")
    if restored is not None:
        batches.position = restored.data_position
        notes.append(f"resuming from checkpoint {restored.directory} (step {restored.step})")
        log["resumed_from"] = {"directory": restored.directory, "step": restored.step}
    elif engine is not None and config.resume:
        notes.append(f"no checkpoint in {config.save_dir} yet: starting from step 0")
    if notes and main:
        print("zinfjax: " + "; ".join(notes), file=sys.stderr)
    return 1 + (restored.step if restored is not None else 0)


class Saver:
    """Checkpoints of a ``zinfjax train`` run: every ``save_every`` steps and after the last one.

    A failed save is reported and training goes on; the previous checkpoints are intact. A failed
    final save fails the run (`close` returns the error). A step whose loss is not finite is never
    saved, and pruning keeps the newest checkpoint that a finite loss has vouched for even beyond
    ``keep_checkpoints`` (see `zinfjax.training.nonfinite`), until the run ends. Each checkpoint records ``config``:
    the run's config as given, its global batch settled, not the tiers or tiles ``tiers=auto`` chose (the log's).
    """

    def __init__(self, config: Config, model_config, trainer, run_id: str | None = None, start: int = 0):
        self.every, self.trainer = config.save_every, trainer
        self.manager = CheckpointManager(config.save_dir, keep=config.keep_checkpoints, config=config,
                                         model=model_config, run_id=run_id)
        if is_main_process() and not getattr(trainer.engine, "base", None):  # a named base keeps the tokenizer
            keep_tokenizer(config.save_dir, config.model, config.tokenizer)
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

    @staticmethod
    def last_complete(saver: Saver | None, verified: bool = False) -> str:
        """Where a failed run can resume from: the newest complete checkpoint, once the save in flight ended.

        ``verified``: the newest whose every chunk's checksum holds (a chunk damaged before a save linked it
        is in that checkpoint too), as ``resume=true`` chooses it."""
        if saver is None:
            return "no save_dir is set, so no checkpoint exists"
        saver.manager.wait(raise_error=False)
        steps, where, damaged = saver.manager.steps(), saver.manager.directory, []
        while verified and steps and not verify_checkpoint(step_dir(where, steps[-1])).complete:
            damaged.append(steps.pop())
        skipped = f" (step {', '.join(map(str, damaged))} fails its checksums; resume skips it)" if damaged else ""
        if not steps:
            return f"no complete checkpoint exists in {where}{skipped}"
        return f"the last complete checkpoint is step {steps[-1]} in {where}{skipped} (resume=true)"

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
    if trainer.engine is None:
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
    """Loss, tokens/s, and for a streamed step the I/O stall, overlap, the step over its disk floor (`floor`) and
    bytes moved per tier."""
    parts = [f"loss={record['loss']:.4f}", f"tok/s={record['tokens_per_s']:.0f}"]
    if "stall_s" in record:
        parts += [f"stall={record['stall_s']:.2f}s", f"overlap={record['overlap']:.0%}"]
    if "floor_ratio" in record:
        parts.append(f"floor={record['floor_ratio']:.2f}x")
    elif "io_ratio" in record:
        parts.append(f"io_floor={record['io_ratio']:.2f}x")
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
