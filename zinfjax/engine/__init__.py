"""The ZeRO-Infinity engine: a program's stages streamed one layer at a time, every part of the state on a tier."""

from zinfjax.engine.compile_cache import compiled, update_plan
from zinfjax.engine.engine import BatchError, Engine
from zinfjax.engine.loss_scale import LossScale
from zinfjax.engine.source import TreeSource

__all__ = ["BatchError", "Engine", "LossScale", "TreeSource", "compiled", "update_plan"]
