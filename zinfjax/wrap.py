"""`zinfjax.wrap`: a Flax ``TrainState`` (Linen) or ``nnx.Optimizer`` (NNX) in, a streaming state out.

Example:
    >>> state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-4))
    >>> state = zinfjax.wrap(state, zinfjax.Config(params="nvme", optimizer="nvme", nvme_path="/mnt/nvme/run1"))
    >>> for batch in batches:
    ...     state, metrics = state.train_step(batch)
"""

from __future__ import annotations

from typing import Any

from zinfjax.config import Config
from zinfjax.engine.engine import Engine
from zinfjax.models.layered import DOCS, LayeredConventionError, get_layers
from zinfjax.sharding import make_mesh


class WrappedState:
    """A training state whose parameters and optimizer state live on the tiers of its config.

    ``train_step(batch)`` runs one optimizer step on a (batch_size, seq_len + 1) token batch and
    returns ``(state, metrics)``. The state is a handle on the stores: the returned state is this
    same object, one step further on.

    Attributes:
        step: optimizer steps taken.
        config: the `Config`.
        engine: the streaming `Engine`.
    """

    def __init__(self, engine: Engine, config: Config, step: int = 0, on_sync=None):
        self.engine, self.config, self.step = engine, config, step
        self._on_sync = on_sync

    def train_step(self, batch) -> tuple[WrappedState, dict[str, Any]]:
        """One optimizer step; ``metrics`` has loss, bytes moved per tier, stall, compute and overlap."""
        expected = (self.config.batch_size, self.config.seq_len + 1)
        if tuple(batch.shape) != expected:
            raise ValueError(f"batch has shape {tuple(batch.shape)}; this state was wrapped for {expected} "
                             f"(Config.batch_size, Config.seq_len + 1)")
        metrics = self.engine.train_step(batch)
        self.step = self.engine.step_count
        return self, {"step": self.step, **metrics}

    @property
    def params(self):
        """The current parameters, gathered into memory (fp32 master weights under mixed precision)."""
        return self.engine.params("master" if self.engine.stores.master else "params")

    def sync(self):
        """Writes the current parameters back into the wrapped NNX model (no-op for Linen); returns them."""
        params = self.params
        if self._on_sync:
            self._on_sync(params)
        return params

    def close(self) -> None:
        """Waits for every write and releases the stores (and their locks)."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wrap(state, config: Config, mesh=None, model=None, restore: str | None = None) -> WrappedState:
    """Wraps a Flax Linen ``TrainState`` or an NNX ``nnx.Optimizer`` for streaming training.

    An ``nnx.Optimizer`` does not hold its model (flax >= 0.11), so NNX users pass ``model=``.
    ``restore`` (a save_dir, or one checkpoint in it) starts from that checkpoint instead of the
    state's parameters, whatever mesh, stage and tiers it was saved with (docs/checkpoint.md).

    The model must follow the layered convention (docs/layered.md): a ``layers()`` method and
    parameters grouped as ``embed``, ``blocks`` (stacked on a layer axis) and ``head``. The
    optax transformation must be elementwise; use ``Config.grad_clip`` for clipping.

    Example:
        >>> state = zinfjax.wrap(state, zinfjax.Config(stage=0, params="host", optimizer="host"))
        >>> state, metrics = state.train_step(batch)
        >>> nnx_state = zinfjax.wrap(nnx.Optimizer(model, tx, wrt=nnx.Param), config, model=model)
        >>> state = zinfjax.wrap(state, config, restore="runs/ckpt")      # resume from the newest checkpoint
    """
    mesh = mesh if mesh is not None else make_mesh(config.mesh_axes())
    batch_shape = (config.batch_size, config.seq_len + 1)
    if _is_nnx_optimizer(state):
        if model is None:
            raise LayeredConventionError("wrapping an nnx.Optimizer needs its model: zinfjax.wrap(optimizer, "
                                         "config, model=model)")
        return _wrap_nnx(state, model, config, mesh, batch_shape, restore)
    for attr in ("apply_fn", "params", "tx"):
        if not hasattr(state, attr):
            raise LayeredConventionError(
                f"zinfjax.wrap takes a flax TrainState or an nnx.Optimizer; {type(state).__name__} has no "
                f"{attr!r}; see {DOCS}"
            )
    model = getattr(state.apply_fn, "__self__", None)
    if model is None:
        raise LayeredConventionError(
            f"state.apply_fn must be the bound apply of a layered model (model.apply); see {DOCS}"
        )
    engine = Engine(get_layers(model), _source(state.params, restore), state.tx, config, mesh, batch_shape)
    return WrappedState(engine, config, engine.step_count if restore else int(getattr(state, "step", 0)))


def _source(params, restore: str | None):
    """The parameters themselves, or the checkpoint to restore in their place."""
    if restore is None:
        return params
    from zinfjax.checkpoint import CheckpointSource

    return CheckpointSource(restore, params)


def _is_nnx_optimizer(state) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax always ships nnx
        return False
    return isinstance(state, nnx.Optimizer)


def _wrap_nnx(optimizer, model, config: Config, mesh, batch_shape, restore: str | None) -> WrappedState:
    from flax import nnx

    linen = getattr(model, "module", None)  # nnx.bridge.ToNNX keeps the Linen module here
    layered = linen if linen is not None else model
    params = nnx.state(model, nnx.Param).to_pure_dict()
    engine = Engine(get_layers(layered), _source(params, restore), optimizer.tx, config, mesh, batch_shape)

    def write_back(new_params) -> None:
        state = nnx.state(model, nnx.Param)
        state.replace_by_pure_dict(new_params)
        nnx.update(model, state)

    step = engine.step_count if restore else int(optimizer.step[...])
    return WrappedState(engine, config, step, on_sync=write_back)
