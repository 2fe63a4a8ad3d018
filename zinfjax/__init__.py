"""zinfjax: ZeRO-Infinity for JAX.

Example:
    >>> import zinfjax
    >>> config = zinfjax.Config(stage=3, params="nvme", optimizer="nvme", nvme_path="/mnt/nvme/run1")
    >>> state = zinfjax.wrap(train_state, config, loss_fn=loss_fn)
    >>> state, metrics = state.train_step(batch)
"""

from zinfjax.allocator import tune_allocator
from zinfjax.checkpoint import CheckpointManager
from zinfjax.config import Config
from zinfjax.engine import BatchError, Engine
from zinfjax.errors import ConfigError, UserError
from zinfjax.inference import Sampling, evaluate, generate
from zinfjax.program import InitError, NotStreamableError, ProgramError
from zinfjax.program.restack import RestackError, stack_layers
from zinfjax.wrap import WrapError, WrappedState, wrap

__version__ = "0.2.0"

__all__ = [
    "BatchError", "CheckpointManager", "Config", "ConfigError", "Engine", "InitError", "NotStreamableError",
    "ProgramError", "RestackError", "Sampling", "UserError", "WrapError", "WrappedState", "__version__", "evaluate",
    "generate", "stack_layers", "tune_allocator", "wrap",
]
