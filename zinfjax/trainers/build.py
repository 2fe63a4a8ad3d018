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
    return model, (EngineTrainer if engine else ReferenceTrainer)(config, model, mesh)
