"""Optimizers and learning-rate schedules from the config.

Example:
    >>> tx = make_optimizer(Config(lr=1e-3, grad_clip=1.0, warmup_steps=100, lr_decay="cosine", steps=1000))
    >>> round(float(make_schedule(Config(lr=1e-3, warmup_steps=10))(5)), 8)     # half way through the warmup
    0.0005
    >>> make_schedule(Config(lr=1e-3))
    0.001
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from zinfjax.config import Config
from zinfjax.models import lora
from zinfjax.trainers.frozen import freeze


def make_schedule(config: Config):
    """The learning rate per optimizer step: a warmup from ``warmup_start_lr`` to ``lr`` over ``warmup_steps``
    (linear, or DeepSpeed's log warmup), then ``lr_decay`` to ``final_lr`` at step ``steps``, or constant.

    Its count lives in the optimizer state, so it is checkpointed and resumes exactly.
    """
    warm, peak = config.warmup_steps, config.lr
    if not warm and config.lr_decay == "constant":
        return peak  # a float: no schedule count in the optimizer state
    rest = max(config.steps - warm, 1)
    decay = {
        "constant": optax.constant_schedule(peak),
        "linear": optax.linear_schedule(peak, config.final_lr, rest),
        "cosine": optax.cosine_decay_schedule(peak, rest, alpha=config.final_lr / peak),
    }[config.lr_decay]
    if not warm:
        return decay
    if config.warmup_type == "log":  # DeepSpeed WarmupLR's default: start + (peak - start) * log(1 + t) / log(warm)
        def warmup(count):
            frac = jnp.log1p(jnp.minimum(count, warm).astype(jnp.float32)) / jnp.log(jnp.float32(warm))
            return config.warmup_start_lr + (peak - config.warmup_start_lr) * jnp.minimum(frac, 1.0)
    else:
        warmup = optax.linear_schedule(config.warmup_start_lr, peak, warm)
    return optax.join_schedules([warmup, decay], [warm])


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """The optax transformation a config asks for, global-norm clipping first when ``grad_clip > 0``; with
    ``lora_rank``, on the LoRA adapters alone (`zinfjax.trainers.frozen.freeze`), the clipping norm theirs.

    zinfjax runs every one of them exactly, one layer at a time (docs/engine.md, "Optimizers").
    """
    lr, wd = make_schedule(config), config.weight_decay
    base = {
        "adamw": lambda: optax.adamw(lr, weight_decay=wd),
        "adam": lambda: optax.adam(lr),
        "sgd": lambda: optax.sgd(lr, momentum=0.9),
        "lion": lambda: optax.lion(lr, weight_decay=wd),
        "adagrad": lambda: optax.adagrad(lr),
        "rmsprop": lambda: optax.rmsprop(lr),
        "lamb": lambda: optax.lamb(lr, weight_decay=wd),
        "adafactor": lambda: optax.adafactor(lr, weight_decay_rate=wd or None),
    }[config.optimizer_name]()
    if config.grad_clip > 0:
        base = optax.chain(optax.clip_by_global_norm(config.grad_clip), base)
    return freeze(base, lora.is_adapter) if config.lora_rank else base  # LoRA: the base gets no update
