"""zinfjax: ZeRO-Infinity for JAX.

The public API is what ``__all__`` lists, documented in docs/api.md (a test holds the two together).

Example:
    >>> import zinfjax
    >>> config = zinfjax.Config(stage=3, params="nvme", optimizer="nvme", nvme_path="/mnt/nvme/run1")
    >>> state = zinfjax.wrap(train_state, config, loss_fn=loss_fn)
    >>> state, metrics = state.train_step(batch)
"""

from importlib.metadata import PackageNotFoundError, version

from zinfjax import models
from zinfjax.checkpoint import CheckpointError, CheckpointManager
from zinfjax.config import Config
from zinfjax.data import Batches, DataError, load_tokens
from zinfjax.engine import BatchError
from zinfjax.engine.budget import MemoryBudgetError
from zinfjax.errors import ConfigError, UserError
from zinfjax.inference import Sampling, evaluate, generate
from zinfjax.models.tiled import TiledDense, TiledMLP
from zinfjax.planning import PlanError, make_plan
from zinfjax.program import InitError, NotStreamableError, ProgramError
from zinfjax.program.restack import RestackError, stack_layers
from zinfjax.runtime.allocator import tune_allocator
from zinfjax.store import StoreError
from zinfjax.trainers import make_optimizer
from zinfjax.training import run
from zinfjax.training.nonfinite import NonFiniteLossError
from zinfjax.wrap import WrapError, WrappedState, wrap

try:
    __version__ = version("zinfjax")  # one version, pyproject.toml's
except PackageNotFoundError:  # a checkout on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = [
    # training your own model, and zinfjax's own loop
    "Config", "wrap", "WrappedState", "run", "make_plan", "make_optimizer", "tune_allocator",
    # models, data and checkpoints
    "models", "TiledDense", "TiledMLP", "Batches", "load_tokens", "CheckpointManager", "stack_layers",
    # inference
    "generate", "evaluate", "Sampling",
    # errors: every one a user can cause is a UserError
    "UserError", "ConfigError", "WrapError", "BatchError", "DataError", "InitError", "ProgramError",
    "NotStreamableError", "RestackError", "MemoryBudgetError", "PlanError", "CheckpointError", "NonFiniteLossError",
    "StoreError",
    "__version__",
]
