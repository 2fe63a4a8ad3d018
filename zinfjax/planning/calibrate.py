"""Calibration: a few timed steps of the engine on the model cut to a few layers, scaled to the whole model."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from zinfjax._util.choices import COMPUTE_DTYPES, TIER_KEYS
from zinfjax.config import Config
from zinfjax.planning.cost import NOMINAL, compute_factor
from zinfjax.planning.probes import disk_seconds
from zinfjax.runtime import allocator
from zinfjax.sections import EngineSettings
from zinfjax.store.threads import io_cpu_seconds

CALIBRATION_LAYERS = 4


CALIBRATION_STEPS = 5  # timed, after one untimed step that compiles; their median (3 left the NVMe rate noisy)


def layer_flops(config: Config, m) -> tuple[float, float]:
    """FLOPs of one step: ``(per layer, the rest)``; forward, recomputed forward and backward (8 x 1 pass)."""
    tokens = config.batch_size * config.seq_len
    kv = m.kv_heads * m.head_dim
    mlp = (3 if m.arch == "llama" else 2) * m.d_model * m.d_ff
    attention = 4 * tokens * config.seq_len * m.d_model
    layer = 2 * tokens * (2 * m.d_model * m.d_model + 2 * m.d_model * kv + mlp) + attention
    rest = 2 * tokens * m.d_model * m.vocab_size
    return 4 * layer, 4 * rest


def recompute_factor(config: Config, model_config) -> float:
    """What the forward run again in the backward costs, against a step that keeps its residuals: the layers'
    share of a step's FLOPs (`layer_flops`), a third more of it.

    Example:
        >>> from zinfjax.models import ModelConfig
        >>> round(recompute_factor(Config(batch_size=1, seq_len=256), ModelConfig.resolve("gpt2-large")), 2)
        1.31
    """
    per_layer, rest = layer_flops(config, model_config)  # each with the forward counted twice
    layers = model_config.n_layers * per_layer * 3 / 4
    return 1 + layers / 3 / (layers + rest * 3 / 4)


def calibration_model(model_config, layers: int = CALIBRATION_LAYERS):
    return model_config.replace(n_layers=min(layers, model_config.n_layers))


def calibration_layers(model_config, state_bytes: int, host_bytes: int) -> int:
    """All the layers when the state takes at most a quarter of the host budget; else `CALIBRATION_LAYERS`, or as
    many as a quarter of the budget holds the state of when that is fewer (at least one).

    Example:
        >>> from zinfjax.models import ModelConfig
        >>> calibration_layers(ModelConfig.resolve("gpt2-large"), 12 << 30, 3 << 30)
        2
    """
    if 4 * state_bytes <= host_bytes:
        return model_config.n_layers
    per_layer = state_bytes / model_config.n_layers
    return int(max(1, min(CALIBRATION_LAYERS, host_bytes // (4 * per_layer))))


def _batch(config: Config, vocab: int):
    return np.random.default_rng(0).integers(0, vocab, (config.batch_size, config.seq_len + 1)).astype(np.int32)


def calibrate_engine(config: Config, model_config, layers: int = CALIBRATION_LAYERS, tier: str = "device",
                     nvme_path: str | None = None) -> dict:
    """Times the engine with every tier on ``tier`` (under ``nvme_path``, default ``config``'s) on a few layers, with
    the budget the engine measures for itself; counts each store's reads and writes per byte.

    ``timed_s`` is the median step as timed; ``step_s`` that over ``slowed``, the factor the engine's own choices
    put on it (`zinfjax.planning.cost.compute_factor`) where a small budget made it recompute or give back its pages.
    """
    from zinfjax import models
    from zinfjax.sharding import make_mesh
    from zinfjax.trainers.streaming import lm_engine

    settings = _calibration_settings(config, tier, nvme_path)
    allocator.trim()  # the budget counts what the process holds: not the pages its heap kept from the last run
    m = calibration_model(model_config, layers)
    engine = lm_engine(models.build(m, COMPUTE_DTYPES[config.precision]), config, make_mesh(config.mesh_axes()),
                       settings=settings)
    try:
        batch = _batch(config, m.vocab_size)
        engine.train_step(batch)
        named = [(k, g, s) for k, d in engine.stores.stores.items() for g, s in d.items()]
        named += [("acts", f"s:scan{p}", s) for p, s in engine.stores.acts.items()]
        before = {(k, g): (s.stats.bytes_read, s.stats.bytes_written) for k, g, s in named}
        steps = [engine.train_step(batch) for _ in range(CALIBRATION_STEPS)]
        traffic = {}
        for k, g, s in named:
            size = s.layer_nbytes * s.num_layers
            r0, w0 = before[(k, g)]
            n = CALIBRATION_STEPS * max(size, 1)
            traffic[f"{k}|{g}"] = ((s.stats.bytes_read - r0) / n, (s.stats.bytes_written - w0) / n)
        slowed = compute_factor({"recompute": not engine.saves_residuals, "returns_pages": engine.strict_heap},
                                recompute_factor(config, m))
    finally:
        engine.close()
    read = sum(s.stats.bytes_read - before[(k, g)][0] for k, g, s in named) / CALIBRATION_STEPS
    written = sum(s.stats.bytes_written - before[(k, g)][1] for k, g, s in named) / CALIBRATION_STEPS
    timed = statistics.median(s["step_s"] for s in steps)
    return {"step_s": timed / slowed, "timed_s": timed, "slowed": slowed, "layers": m.n_layers, "traffic": traffic,
            "bytes_per_step": read + written, "read_per_step": read, "written_per_step": written,
            "io_cpu_s": statistics.median(io_cpu_seconds(s) for s in steps)}


def _calibration_settings(config: Config, tier: str, nvme_path: str | None) -> EngineSettings:
    """``config``'s engine settings with every tier key on ``tier`` (under ``nvme_path``, if given) and no memory_limit:
    what the calibration asks the engine about, the run's config left as it is."""
    settings = config.engine_settings()
    tiering = settings.tiering.replace(**dict.fromkeys(TIER_KEYS, tier), tiers="manual",
                                       nvme_path=nvme_path or settings.tiering.nvme_path)
    return settings.replace(tiering=tiering, memory=settings.memory.replace(memory_limit=None))


def added_rate(device: dict, tier: dict, floor: float) -> float:
    """GB/s a tier adds to the step per byte it moves: that tier's step over the device-tier step, per byte.

    The engine's copies and I/O overlap its compute in part, so this effective rate is what predicts
    a step; when the difference is lost in noise, ``floor`` (a bare copy's or the disk's rate) stands
    in, or the rate that would add 2% to the step if that is higher.

    Example:
        >>> added_rate({"step_s": 1.0}, {"step_s": 1.5, "bytes_per_step": 1e9}, 1.0)
        2.0
    """
    extra = tier["step_s"] - device["step_s"]
    if extra <= 0.02 * device["step_s"] or tier["bytes_per_step"] <= 0:
        return max(floor, tier["bytes_per_step"] / max(0.02 * device["step_s"], 1e-9) / 1e9)
    return tier["bytes_per_step"] / extra / 1e9


def io_cpu_rate(device: dict, tier: dict, floor: float) -> float:
    """GB/s the NVMe tier adds to a step on the CPU backend: the bytes its timing run moved over the CPU seconds its
    I/O path took (`zinfjax.store.threads.io_cpu_seconds`); `added_rate` where that run counted no I/O CPU.

    On two cores XLA's operations split over both, and wait for the slower half: a core-second the I/O path takes
    delays the step by about a second. Across the budget sweep (docs/BENCHMARKS.md, "Memory first") the seconds
    the NVMe bytes added to a step came within a quarter of the I/O path's CPU seconds, while the step over the
    device step of the timing run (`added_rate`) said nothing where the disk bounded that run: llama-1b's was
    2.2 GB/s against the 3.2-3.7 its capped steps showed.

    Example:
        >>> io_cpu_rate({"step_s": 1.0}, {"step_s": 3.0, "bytes_per_step": 6e9, "io_cpu_s": 2.0}, 1.0)
        3.0
    """
    if tier.get("io_cpu_s", 0.0) <= 0 or tier["bytes_per_step"] <= 0:
        return added_rate(device, tier, floor)
    return tier["bytes_per_step"] / tier["io_cpu_s"] / 1e9


def disk_efficiency(device: dict, tier: dict, rates: dict) -> float:
    """How near the disk's own time (`disk_seconds` at the probed rates) the engine's NVMe step came where the disk
    bounded its timing run: that time over the step. 1.0 where compute and the I/O path's CPU bounded it instead
    (the device step and the I/O CPU seconds add up to more than the disk's time).

    Example:
        >>> rates = {"disk_read_GBps": 2.0, "disk_write_GBps": 2.0, "disk_mixed_GBps": 2.0}
        >>> tier = {"timed_s": 5.0, "read_per_step": 4e9, "written_per_step": 4e9, "io_cpu_s": 1.0}
        >>> disk_efficiency({"timed_s": 1.0}, tier, rates)
        0.8
    """
    disk = disk_seconds(tier["read_per_step"], tier["written_per_step"], rates)
    if disk <= device["timed_s"] + tier.get("io_cpu_s", 0.0):
        return 1.0
    return min(1.0, disk / tier["timed_s"])


def calibrate_nvme(config: Config, model_config, layers: int) -> dict:
    """`calibrate_engine` with every tier on nvme, in a scratch directory under ``nvme_path`` removed after."""
    os.makedirs(config.nvme_path, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".zinfjax-plan-", dir=config.nvme_path)
    try:
        return calibrate_engine(config, model_config, layers, tier="nvme", nvme_path=scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def calibrate_reference(config: Config, model_config, layers: int = CALIBRATION_LAYERS) -> float:
    """Median step time of the in-memory reference trainer (every tier on device, stage 0) on a few layers."""
    from zinfjax import models
    from zinfjax.sharding import make_mesh
    from zinfjax.trainers.reference import ReferenceTrainer

    m = calibration_model(model_config, layers)
    trainer = ReferenceTrainer(config, models.build(m, COMPUTE_DTYPES[config.precision]), make_mesh(config.mesh_axes()))
    batch = _batch(config, m.vocab_size)
    trainer.step(batch)
    times = []
    for _ in range(CALIBRATION_STEPS):
        t0 = time.perf_counter()
        trainer.step(batch)  # float(loss) waits for the step
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scale_to_model(seconds: float, config: Config, model_config, layers: int) -> float:
    """A step timed on ``layers`` layers, scaled to all of them by FLOPs."""
    per_layer, rest = layer_flops(config, model_config)
    return seconds * (rest + model_config.n_layers * per_layer) / (rest + layers * per_layer)


def nominal_compute(config: Config, model_config) -> float:
    per_layer, rest = layer_flops(config, model_config)
    return (rest + model_config.n_layers * per_layer) / NOMINAL["flops_per_s"]
