"""The ZeRO-Infinity engine: a program's stages streamed one layer at a time, every part of the state on a tier.

What this module exports is the package's contract with the rest of zinfjax: the engine, its errors
and loss scale, the source of its initial state, and the layout caches (`compiled`, `update_plan`)
that training, wrapping and planning share with it. Modules whose names begin with an underscore
(the step, its updates, their interface to the engine) are the engine's internals.
"""

from zinfjax.engine.compile_cache import compiled, update_plan
from zinfjax.engine.engine import BatchError, Engine
from zinfjax.engine.loss_scale import LossScale
from zinfjax.engine.source import Source, TreeSource

__all__ = ["BatchError", "Engine", "LossScale", "Source", "TreeSource", "compiled", "update_plan"]
