"""zinfjax: ZeRO-Infinity for JAX.

The public API is what ``__all__`` lists, documented in docs/api.md (a test holds the two together).

Example (a loss over three layers, a scan over their stacked weights; a Flax model: `zinfjax.wrap`):
    >>> import jax, jax.numpy as jnp, optax, tempfile, zinfjax
    >>> from flax.training import train_state
    >>> def loss_fn(params, batch):
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
    ...     return jnp.mean(h ** 2)
    >>> train = train_state.TrainState.create(apply_fn=None, params={"blocks": jnp.ones((3, 8, 8)) / 8},
    ...                                       tx=optax.sgd(0.1))
    >>> config = zinfjax.Config(params="nvme", optimizer="nvme", nvme_path=tempfile.mkdtemp())
    >>> state = zinfjax.wrap(train, config, loss_fn=loss_fn)
    >>> state, metrics = state.train_step(jnp.ones((8, 8)))
    >>> metrics["step"], metrics["read_bytes_nvme"] > 0
    (1, True)
    >>> state.close()
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
