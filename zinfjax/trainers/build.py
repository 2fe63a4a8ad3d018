"""The trainer a config describes: the in-memory reference for a plain run, the streaming engine otherwise."""

from __future__ import annotations

from zinfjax import models
from zinfjax._util.choices import COMPUTE_DTYPES, TIER_KEYS
from zinfjax.checkpoint.model import resolve_model
from zinfjax.config import Config
from zinfjax.errors import ConfigError
from zinfjax.models.configs import ModelConfig
from zinfjax.sharding import check_batch, make_mesh
from zinfjax.trainers.reference import ReferenceTrainer
from zinfjax.trainers.streaming import EngineTrainer, choose_tiles


def uses_engine(config: Config) -> bool:
    """The reference trainer serves a plain in-memory run; anything offloaded, sharded or checkpointed streams."""
    return config.stage > 0 or bool(config.save_dir) or any(getattr(config, k) != "device" for k in TIER_KEYS)


def run_model(config: Config) -> tuple[Config, ModelConfig]:
    """The model a config trains (its tiles, its LoRA adapters), and the config with the adapters a model
    checkpoint records (an adapter converted from PEFT trains on with them)."""
    model_config = resolve_model(config.model)
    if config.tiles != "auto":
        model_config = model_config.replace(tiles=int(config.tiles))
    if not config.lora_rank and model_config.lora_rank:
        config = config.replace(lora_rank=model_config.lora_rank, lora_alpha=model_config.lora_alpha,
                                lora_targets=",".join(model_config.lora_targets),
                                lora_dropout=model_config.lora_dropout)
    if config.lora_rank:  # adapters run in untiled blocks (models/lora.py)
        model_config = model_config.replace(
            tiles=1 if config.tiles == "auto" else model_config.tiles, lora_rank=config.lora_rank,
            lora_alpha=config.lora_alpha, lora_targets=tuple(t.strip() for t in config.lora_targets.split(",") if t),
            lora_dropout=config.lora_dropout)
    return config, model_config


def build_trainer(config: Config):
    """The model, mesh and trainer a config describes."""
    config, model_config = run_model(config)
    mesh = make_mesh(config.mesh_axes())
    check_batch(config.batch_size, mesh, config.grad_accum)
    if config.seq_len > model_config.max_seq_len:
        raise ConfigError(f"seq_len={config.seq_len} exceeds the model's context of {model_config.max_seq_len}")
    engine = uses_engine(config)
    if engine and config.tiles == "auto" and not config.lora_rank:
        model_config = choose_tiles(model_config, config, mesh)
    model = models.build(model_config, COMPUTE_DTYPES[config.precision])
    if not engine:
        check_in_memory(config, model)
    return model, (EngineTrainer if engine else ReferenceTrainer)(config, model, mesh)


def check_in_memory(config: Config, model) -> None:
    """Refuses a plain in-memory run whose state (parameters, optimizer state, gradients) and the compiler's reserve
    exceed the memory budget (``memory_limit``, else the cgroup or what is available), before anything is built:
    with what is short and the keys that fix it. The engine's runs hold their own budget (`zinfjax.engine.budget`)."""
    import jax
    import numpy as np

    from zinfjax._util.byte_sizes import format_bytes
    from zinfjax.engine.budget import COMPILE_RESERVE, MemoryBudgetError, default_limit
    from zinfjax.models.stacked import lm_init
    from zinfjax.runtime import rss
    from zinfjax.trainers.optimizers import make_optimizer

    def nbytes(tree) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    params = jax.eval_shape(lm_init(model), jax.random.key(0))
    state = jax.eval_shape(make_optimizer(config).init, params)
    held = {"parameters": nbytes(params), "optimizer state": nbytes(state)}
    held["gradients"] = held["parameters"]
    limit, source = (int(config.memory_limit), "memory_limit") if config.memory_limit else default_limit()
    baseline = rss.current_bytes()
    need = baseline + sum(held.values()) + COMPILE_RESERVE
    if need > limit:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in held.items())
        raise MemoryBudgetError(
            f"{config.model} trained in memory needs {format_bytes(need)} ({parts}, {format_bytes(baseline)} this "
            f"process holds and the compiler's {format_bytes(COMPILE_RESERVE)}), {format_bytes(need - limit)} more "
            f"than the budget of {format_bytes(limit)} ({source}); set nvme_path=/path/on/fast/disk (the plan then "
            "puts what does not fit on NVMe), or choose tiers (optimizer=nvme), or raise memory_limit")
