"""Reference models in the layered convention (embed, stacked blocks, head+loss): GPT-2, Llama, BERT.

And layers that stream tile by tile (`TiledDense`, `TiledMLP`; ``zinfjax.models.tiled``).

Example:
    >>> from zinfjax import models
    >>> model = models.build("gpt2-tiny")
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from zinfjax.models.bert import Bert, BertInputs, mean_pool
from zinfjax.models.configs import NAMED, ModelConfig
from zinfjax.models.gpt import GPT
from zinfjax.models.layered import (
    LayeredConventionError,
    LayeredModel,
    Layers,
    check_params,
    get_layers,
    layer_slice,
    loss_fn,
)
from zinfjax.models.llama import Llama
from zinfjax.models.tiled import TiledDense, TiledMLP, tile_kernel, untile_kernel

ARCHS = {"gpt2": GPT, "llama": Llama, "bert": Bert}


def build(model: str | ModelConfig, dtype: Any = jnp.float32):
    """Builds a reference model from a `ModelConfig`, or what `ModelConfig.resolve` takes (a named size).

    Example:
        >>> model = build("llama-tiny")
    """
    config = ModelConfig.resolve(model) if isinstance(model, str) else model
    return ARCHS[config.arch](config, dtype)


__all__ = [
    "ARCHS", "Bert", "BertInputs", "GPT", "Llama", "LayeredConventionError", "LayeredModel", "Layers",
    "ModelConfig", "NAMED", "build", "check_params", "get_layers", "layer_slice", "loss_fn", "mean_pool",
    "TiledDense", "TiledMLP", "tile_kernel", "untile_kernel",
]
