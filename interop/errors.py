"""Errors of checkpoint conversion: each names the tensor, key or architecture at fault."""

from __future__ import annotations

from zinfjax.errors import ConfigError, UserError


class ConversionError(UserError):
    """A checkpoint that cannot be converted."""


class UnknownArchitectureError(ConversionError, ConfigError):
    """config.json names a model type that has no conversion table."""


class UnsupportedConfigError(ConversionError, ConfigError):
    """config.json asks for a variant of the architecture that the zinfjax model does not compute."""


class MissingTensorError(ConversionError):
    """The checkpoint lacks a tensor that the model needs."""


class UnexpectedTensorError(ConversionError):
    """The checkpoint holds a tensor that no table entry maps."""


class ShapeMismatchError(ConversionError):
    """A tensor's shape differs from the one the config implies."""


class CheckpointFilesError(ConversionError):
    """The directory has no checkpoint files that can be read."""


class AdapterError(ConversionError):
    """LoRA adapters that cannot be converted: none there, a PEFT variant zinfjax does not compute, or a module
    zinfjax cannot map."""
