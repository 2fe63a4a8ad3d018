"""Optimizers from the config.

Example:
    >>> tx = make_optimizer(Config(lr=1e-3, grad_clip=1.0))
"""

from __future__ import annotations

import optax

from zinfjax.config import Config


def make_optimizer(config: Config) -> optax.GradientTransformation:
    """The optax transformation a config asks for, global-norm clipping first when ``grad_clip > 0``."""
    lr, wd = config.lr, config.weight_decay
    base = {
        "adamw": lambda: optax.adamw(lr, weight_decay=wd),
        "adam": lambda: optax.adam(lr),
        "sgd": lambda: optax.sgd(lr, momentum=0.9),
        "lion": lambda: optax.lion(lr, weight_decay=wd),
        "adagrad": lambda: optax.adagrad(lr),
    }[config.optimizer_name]()
    if config.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip), base)
    return base
