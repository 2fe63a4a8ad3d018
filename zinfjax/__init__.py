"""zinfjax: ZeRO-Infinity for JAX.

Example:
    >>> import zinfjax
    >>> config = zinfjax.Config(stage=3, params="nvme", optimizer="nvme", nvme_path="/mnt/nvme/run1")
    >>> state = zinfjax.wrap(train_state, config)
    >>> state, metrics = state.train_step(batch)
"""

from zinfjax.allocator import tune_allocator
from zinfjax.checkpoint import CheckpointManager
from zinfjax.config import Config
from zinfjax.engine import Engine, NotElementwiseError
from zinfjax.errors import ConfigError, UserError
from zinfjax.inference import Sampling, evaluate, generate
from zinfjax.models.layered import LayeredConventionError, Layers
from zinfjax.wrap import WrappedState, wrap

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "Config", "ConfigError", "Engine", "LayeredConventionError", "Layers", "NotElementwiseError",
    "Sampling", "UserError", "WrappedState", "__version__", "evaluate", "generate", "tune_allocator", "wrap",
]
