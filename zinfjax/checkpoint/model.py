"""The model a run names: a named size, a ModelConfig file, or the model a zinfjax checkpoint records."""

from __future__ import annotations

import os

from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.errors import CheckpointError
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.models import ModelConfig


def checkpoint_model(path: str) -> tuple[str, ModelConfig]:
    """The checkpoint directory ``path`` names and the model it was saved with.

    Example:
        >>> import jax, jax.numpy as jnp, tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> from zinfjax.models import build
        >>> model = ModelConfig.named("gpt2-tiny")
        >>> params = jax.jit(build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> save_dir = tempfile.mkdtemp()
        >>> path = write_params(save_dir, params, step=100, model=model)
        >>> directory, recorded = checkpoint_model(save_dir)
        >>> directory == path, recorded.arch, recorded == model
        (True, 'gpt2', True)
    """
    directory = latest_checkpoint(path)
    meta = fmt.read_meta(directory)
    if not meta.get("items", {}).get("params"):
        raise CheckpointError(f"{directory} holds no parameters; give a training checkpoint or one written by "
                              "`zinfjax convert`")
    model = meta.get("model")
    if not model or "arch" not in model:
        raise CheckpointError(f"{directory} does not record its model (it was saved without one); save through "
                              "`zinfjax train` or `zinfjax convert`, which record it")
    return directory, ModelConfig.from_dict(model, f"the model recorded in {directory}")


def resolve_model(spec: str) -> ModelConfig:
    """A named size, a ModelConfig JSON/YAML file, or the model a zinfjax checkpoint (or save_dir) records.

    Example:
        >>> resolve_model("gpt2-tiny").n_layers
        4
        >>> import numpy as np, tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> save_dir = tempfile.mkdtemp()         # a checkpoint that records its model, as `zinfjax convert` writes
        >>> path = write_params(save_dir, {"w": np.ones(4, np.float32)}, model=ModelConfig.named("llama-tiny"))
        >>> resolve_model(save_dir).arch
        'llama'
    """
    if os.path.isdir(spec):
        return checkpoint_model(spec)[1]
    return ModelConfig.resolve(spec)


def start_checkpoint(spec: str) -> str | None:
    """The checkpoint a fresh run of the model ``spec`` starts from: the newest in ``spec`` when it is a checkpoint
    directory (a converted model, an earlier run), else None (the model's own initialiser)."""
    return checkpoint_model(spec)[0] if os.path.isdir(spec) else None
