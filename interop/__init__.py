"""Torch interop: convert Hugging Face, DeepSpeed and torch checkpoints to zinfjax and back.

This package imports torch. The zinfjax library never imports it; only the
``zinfjax convert`` command does, lazily, so torch stays an optional extra.

Example:
    >>> from zinfjax_interop import convert, load_hf, save_hf
    >>> config, params = load_hf("path/to/hf-model")   # GPT-2, Llama or BERT
    >>> save_hf(params, config, "path/to/out")
    >>> convert("path/to/ds-run", "runs/from-ds")        # a DeepSpeed ZeRO checkpoint, Adam state included
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
