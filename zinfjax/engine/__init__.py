"""The ZeRO-Infinity engine: a program's stages streamed one layer at a time, every part of the state on a tier."""

from zinfjax.engine.engine import BatchError, Engine, update_plan
from zinfjax.engine.loss_scale import LossScale
from zinfjax.engine.source import TreeSource

__all__ = ["BatchError", "Engine", "LossScale", "TreeSource", "update_plan"]
