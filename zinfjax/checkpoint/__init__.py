"""Checkpoints: sharded, asynchronous, atomic and reshardable, straight from every tier.

See docs/checkpoint.md.

Example:
    >>> import jax, jax.numpy as jnp, optax, tempfile, zinfjax
    >>> from flax.training import train_state
    >>> def loss_fn(params, batch):                            # three layers: a scan over their stacked weights
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
    ...     return jnp.mean(h ** 2)
    >>> train = train_state.TrainState.create(apply_fn=None, params={"blocks": jnp.ones((3, 8, 8)) / 8},
    ...                                       tx=optax.adam(1e-3))
    >>> state = zinfjax.wrap(train, zinfjax.Config(params="nvme", nvme_path=tempfile.mkdtemp()), loss_fn=loss_fn)
    >>> state, metrics = state.train_step(jnp.ones((8, 8)))
    >>> manager = CheckpointManager(tempfile.mkdtemp(), keep=3)
    >>> manager.save(state)                                   # async; training goes on
    1
    >>> manager.close(); state.close()
    >>> state = zinfjax.wrap(train, zinfjax.Config(params="host"), loss_fn=loss_fn, restore=manager.directory)
    >>> state, metrics = state.train_step(jnp.ones((8, 8)))  # any mesh, stage, tiers: step 2 of the same run
    >>> metrics["step"]
    2
    >>> state.close()
"""

from zinfjax.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)
from zinfjax.checkpoint.format import complete_steps, read_meta
from zinfjax.checkpoint.manager import CheckpointManager, latest_checkpoint
from zinfjax.checkpoint.restore import CheckpointSource
from zinfjax.checkpoint.writer import CheckpointWriter, expected_leaves

__all__ = [
    "CheckpointCorruptError", "CheckpointError", "CheckpointManager", "CheckpointMismatchError",
    "CheckpointNotFoundError", "CheckpointSaveError", "CheckpointSource", "CheckpointWriter", "complete_steps",
    "expected_leaves", "latest_checkpoint", "read_meta",
]
