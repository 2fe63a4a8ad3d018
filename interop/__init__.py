"""Torch interop: convert Hugging Face, DeepSpeed and torch checkpoints to zinfjax and back.

This package imports torch. The zinfjax library never imports it; only the
``zinfjax convert`` command does, lazily, so torch stays an optional extra.

Example (a DeepSpeed ZeRO save dir converts the same way, Adam state included: `zinfjax_interop.deepspeed`):
    >>> import numpy as np, tempfile
    >>> from zinfjax.models import ModelConfig
    >>> from zinfjax_interop import convert, load_hf, save_hf
    >>> from zinfjax_interop.hf import zinfjax_shapes
    >>> config, rng = ModelConfig.named("llama-tiny"), np.random.default_rng(0)   # GPT-2, Llama or BERT: a Llama
    >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
    >>> hf_dir = tempfile.mkdtemp(); save_hf(params, config, hf_dir)             # as Hugging Face saves one
    >>> config, params = load_hf(hf_dir)
    >>> params["blocks"]["q"]["kernel"].shape
    (4, 128, 16, 8)
    >>> convert(hf_dir, tempfile.mkdtemp())["step"]         # a zinfjax checkpoint that training resumes from
    0
"""

from zinfjax_interop.convert import ZinfjaxCheckpoint, convert, detect_format
from zinfjax_interop.deepspeed import convert_deepspeed
from zinfjax_interop.errors import (
    AdapterError,
    CheckpointFilesError,
    ConversionError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
    UnsupportedConfigError,
)
from zinfjax_interop.hf import HFCheckpoint, Tensor, load_hf, save_hf, write_hf
from zinfjax_interop.hf_config import from_hf_config, to_hf_config
from zinfjax_interop.mapping import MappingError, load_mapping

__all__ = [
    "AdapterError", "CheckpointFilesError", "ConversionError", "HFCheckpoint", "MappingError", "MissingTensorError",
    "ShapeMismatchError", "Tensor", "UnexpectedTensorError", "UnknownArchitectureError", "UnsupportedConfigError",
    "ZinfjaxCheckpoint", "convert", "convert_deepspeed", "detect_format", "from_hf_config", "load_hf",
    "load_mapping", "save_hf", "to_hf_config", "write_hf",
]
