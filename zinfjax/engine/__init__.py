"""The ZeRO-Infinity engine: a prefetching per-layer scan with every part of the state on a tier."""

from zinfjax.engine.engine import Engine
from zinfjax.engine.update import NotElementwiseError, check_elementwise

__all__ = ["Engine", "NotElementwiseError", "check_elementwise"]
