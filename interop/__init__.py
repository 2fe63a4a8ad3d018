"""Torch interop: convert Hugging Face, DeepSpeed and torch checkpoints to zinfjax and back.

This package imports torch. The zinfjax library never imports it; only the
``zinfjax convert`` command does, lazily, so torch stays an optional extra.

Example:
    >>> from interop import load_hf, save_hf
    >>> config, params = load_hf("path/to/hf-model")   # GPT-2, Llama or BERT
    >>> save_hf(params, config, "path/to/out")
"""

from interop.errors import (
    CheckpointFilesError,
    ConversionError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
    UnsupportedConfigError,
)
from interop.hf import HFCheckpoint, Tensor, load_hf, save_hf
from interop.hf_config import from_hf_config, to_hf_config

__all__ = [
    "CheckpointFilesError", "ConversionError", "HFCheckpoint", "MissingTensorError", "ShapeMismatchError",
    "Tensor", "UnexpectedTensorError", "UnknownArchitectureError", "UnsupportedConfigError",
    "from_hf_config", "load_hf", "save_hf", "to_hf_config",
]
