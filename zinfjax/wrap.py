"""`zinfjax.wrap`: a Flax ``TrainState`` (Linen) or ``nnx.Optimizer`` (NNX) in, a streaming state out.

Any Flax model whose repeated blocks are ``nn.scan`` / ``nnx.scan`` over stacked parameters streams:
give the loss you would pass to ``jax.grad`` in your own loop. zinfjax cuts it at its scans
(`zinfjax.program`), keeps every part of the state on its tier, and trains exactly as the plain
in-memory optax loop would.

Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, tempfile, zinfjax
    >>> from flax.training import train_state
    >>> class Block(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, h, _):
    ...         return jnp.tanh(nn.Dense(8)(h)), None
    >>> class Model(nn.Module):                     # four blocks: one nn.scan over stacked parameters
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         h, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(x, None)
    ...         return nn.Dense(1)(h)[:, 0]
    >>> model, batch = Model(), {"x": jnp.ones((8, 8)), "y": jnp.zeros(8)}
    >>> params = model.init(jax.random.key(0), batch["x"])["params"]
    >>> state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2))
    >>> def loss_fn(params, batch):                 # what you would pass to jax.grad
    ...     return jnp.mean((model.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)
    >>> config = zinfjax.Config(params="nvme", optimizer="nvme", nvme_path=tempfile.mkdtemp())
    >>> state = zinfjax.wrap(state, config, loss_fn=loss_fn)
    >>> for _ in range(2):
    ...     state, metrics = state.train_step(batch)
    >>> metrics["step"], metrics["read_bytes_nvme"] > 0
    (2, True)
    >>> state.close()

A model too large for memory starts from abstract parameters and an initialiser, and is never whole in memory: each
layer is initialised straight into its tier (``init_fn``):

    >>> def loss_fn(params, batch):                 # three layers: a scan over their stacked weights
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
    ...     return jnp.mean(h ** 2)
    >>> init_fn = lambda rng: {"blocks": jax.random.normal(rng, (3, 8, 8)) / 8}
    >>> abstract = jax.eval_shape(init_fn, jax.random.key(0))
    >>> state = train_state.TrainState.create(apply_fn=None, params=abstract, tx=optax.adam(1e-3))
    >>> state = zinfjax.wrap(state, config, loss_fn=loss_fn, init_fn=init_fn)
    >>> state, metrics = state.train_step(jnp.ones((8, 8)))
    >>> state.read_params()["blocks"].shape
    (3, 8, 8)
    >>> state.close()
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.checkpoint import CheckpointSource
from zinfjax.config import Config
from zinfjax.engine import BatchError, Engine, update_plan
from zinfjax.engine.engine import streamed_program
from zinfjax.engine.source import TreeSource
from zinfjax.errors import UserError
from zinfjax.models.stacked import StackedLM, lm_init, lm_loss
from zinfjax.program import InitSource, program_for
from zinfjax.sharding import make_mesh
from zinfjax.trainers.frozen import by_path, carried_state, check_selects, freeze

DOCS = "docs/models.md"


class WrapError(UserError):
    """What was given to `wrap` cannot be wrapped as it is."""


class WrappedState:
    """A training state whose parameters and optimizer state live on the tiers of its config.

    ``train_step(batch)`` runs one optimizer step and returns ``(state, metrics)``. The state is a
    handle on the stores: the returned state is this same object, one step further on. The engine
    is built at the first step when the batch's structure was not known at `wrap`.

    Attributes:
        step: optimizer steps taken.
        config: the `Config`, as given (the engine keeps what it derives: ``engine.budget``, ``engine.update_on``);
            a `CheckpointManager` without a config of its own records it.
    """

    def __init__(self, build, config: Config, step: int = 0, on_sync=None, engine: Engine | None = None):
        self._build, self.config, self.step, self._on_sync = build, config, step, on_sync
        self._engine = engine

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise WrapError("the state has not trained a step yet: call train_step(batch) first")
        return self._engine

    def train_step(self, batch, rng=None) -> tuple[WrappedState, dict[str, Any]]:
        """One optimizer step on ``batch`` (a pytree of arrays with a leading batch axis).

        ``rng`` overrides the step's key for a loss that takes one (by default
        ``fold_in(key(config.seed), step)``).
        """
        _check_batch_axis(batch)
        if self._engine is None:
            self._engine = self._build(batch)
        metrics = self._engine.train_step(batch, rng)
        self.step = self._engine.step_count
        return self, {"step": self.step, **metrics}

    def read_params(self):
        """The current parameters in your tree's layout, read back from their tiers into memory (fp32 master
        weights): the whole model, from NVMe where it lives there."""
        return self.engine.params()

    def read_opt_state(self):
        """The current optax state of the whole tree, read back from its tier into memory."""
        return self.engine.opt_state()

    # A Flax ``TrainState`` has ``params`` and ``opt_state`` attributes, and this state had them as properties until
    # they became `read_params` and `read_opt_state`: a name that reads the whole model back from its tiers should
    # say so. The old names still work, and say once per process what to call instead: a FutureWarning, which Python
    # shows by default wherever the call is (a DeprecationWarning is shown only for code run as ``__main__``).
    _warned: set[str] = set()

    def _renamed(self, old: str, new: str) -> None:
        if old not in WrappedState._warned:
            WrappedState._warned.add(old)
            warnings.warn(f"WrappedState.{old} is deprecated and will be removed: call state.{new}() instead (it "
                          "reads the whole tree back from its tiers into memory)", FutureWarning, stacklevel=3)

    @property
    def params(self):
        """Deprecated: `read_params` (this warns once, then returns ``read_params()``)."""
        self._renamed("params", "read_params")
        return self.read_params()

    @property
    def opt_state(self):
        """Deprecated: `read_opt_state` (this warns once, then returns ``read_opt_state()``)."""
        self._renamed("opt_state", "read_opt_state")
        return self.read_opt_state()

    def sync(self):
        """Writes the current parameters back into the wrapped NNX model (no-op for Linen); returns them."""
        params = self.read_params()
        if self._on_sync:
            self._on_sync(params)
        return params

    def close(self) -> None:
        """Waits for every write and releases the stores (and their locks)."""
        if self._engine is not None:
            self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def wrap(state, config: Config, loss_fn=None, *, init_fn=None, mesh=None, model=None, restore: str | None = None,
         batch=None, partition_rules: tuple = (), trainable=None) -> WrappedState:
    """Wraps a Flax Linen ``TrainState`` or an NNX ``nnx.Optimizer`` for streaming training.

    Args:
        state: a ``TrainState`` (params, tx, opt_state and step are kept), or an ``nnx.Optimizer``.
        config: the `Config`: tiers, stage, mesh, precision, accumulation.
        loss_fn: ``loss_fn(params, batch) -> scalar``, or ``(params, batch, rng)`` for dropout; for NNX,
            ``loss_fn(model, batch[, rng])``. None for zinfjax's own language models, whose batch is
            ``(batch_size, seq_len + 1)`` tokens.
        init_fn: ``init_fn(rng) -> params``, for a state whose params are abstract
            (``jax.eval_shape``): the parameters are then initialised one layer at a time, straight into
            their tiers, so a model larger than memory never exists whole.
        mesh: a ``("data", "model")`` mesh; by default ``config.mesh``.
        model: the NNX model (an ``nnx.Optimizer`` does not hold it).
        restore: a save_dir (or one checkpoint) to start from instead (docs/checkpoint.md).
        batch: an example batch (or ``ShapeDtypeStruct``s), to build the engine now rather than at
            the first step.
        partition_rules: tensor-parallel rules ``(path pattern, per-layer spec)`` (docs/sharding.md).
        trainable: ``trainable(path, leaf) -> bool`` (``path``: ``"blocks/q_lora/a"``): train these alone, the rest
            frozen (docs/engine.md, "Frozen parameters"); the optimizer starts afresh, so wrap a state at step 0.

    Example (the module docstring wraps and trains a Linen model, and one from abstract parameters):
        >>> wrap(object(), Config())
        Traceback (most recent call last):
        zinfjax.wrap.WrapError: zinfjax.wrap takes a flax TrainState or an nnx.Optimizer; object has no 'params'
    """
    mesh = mesh if mesh is not None else make_mesh(config.mesh_axes())
    if _is_nnx_optimizer(state):
        if trainable is not None:
            raise WrapError("an nnx.Optimizer says what trains with its wrt filter (nnx.Optimizer(model, tx, "
                            "wrt=nnx.LoRAParam)); trainable= is for a Linen TrainState")
        return _wrap_nnx(state, config, loss_fn, mesh, model, restore, batch, partition_rules)
    _check_train_state(state)
    if loss_fn is None:
        loss_fn, init_fn, batch, partition_rules = _own_lm(state, config, init_fn, batch, partition_rules)
    abstract = _is_abstract(state.params)
    if abstract and init_fn is None and restore is None:
        raise WrapError("the state's params are abstract (jax.eval_shape); pass init_fn=lambda rng: "
                        "model.init(rng, example)['params'] so zinfjax initialises them one layer at a time")
    opt_state = None if abstract else getattr(state, "opt_state", None)
    step = 0 if abstract else int(getattr(state, "step", 0))
    tx = state.tx
    if trainable is not None:
        tx, opt_state = _selected(state, trainable, step, opt_state)

    def source_for(program, plan):
        if restore is not None:
            return CheckpointSource(restore, program, plan)
        if abstract:
            return InitSource(program, init_fn, jax.random.key(config.seed))
        return TreeSource(program, plan, state.params, _checked_state(opt_state, plan), step)

    build = _builder(loss_fn, state.params, tx, config, mesh, partition_rules, source_for)
    engine = build(batch) if batch is not None else None
    return WrappedState(build, config, engine.step_count if engine is not None else step, engine=engine)


def _check_train_state(state) -> None:
    if isinstance(state, WrappedState):
        raise WrapError("this state is wrapped already: train it with its own train_step")
    for attr in ("params", "tx"):
        if not hasattr(state, attr):
            raise WrapError(f"zinfjax.wrap takes a flax TrainState or an nnx.Optimizer; {type(state).__name__} has no "
                            f"{attr!r}")


def _own_lm(state, config: Config, init_fn, batch, partition_rules):
    """The loss, initialiser, batch and tensor-parallel rules of a state of zinfjax's own language models."""
    module = getattr(getattr(state, "apply_fn", None), "__self__", None)
    if not isinstance(module, StackedLM):
        raise WrapError("give zinfjax.wrap your loss: wrap(state, config, loss_fn=loss_fn), with "
                        f"loss_fn(params, batch) -> scalar as you would pass it to jax.grad (see {DOCS})")
    batch = batch if batch is not None else jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
    return lm_loss(module), init_fn or lm_init(module), batch, partition_rules or module.partition_rules


def _selected(state, trainable, step: int, opt_state):
    """``state.tx`` on the parameters ``trainable`` selects, no update for the rest, and its fresh state (None for
    abstract parameters, which the engine initialises)."""
    if step:
        raise WrapError(f"trainable= starts the optimizer afresh, and the state is at step {step}; wrap it at step 0, "
                        "or freeze with optax.multi_transform in its tx yourself")
    tx = freeze(state.tx, by_path(trainable, state.params))
    return tx, None if opt_state is None else tx.init(state.params)


def _builder(loss_fn, params, tx, config: Config, mesh, partition_rules, source_for):
    """``build(batch) -> Engine``: traces the loss on one micro-batch of ``batch``'s structure and fills the stores."""
    with_rng = _takes_rng(loss_fn)
    compute = COMPUTE_DTYPES[config.precision]
    params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _compute_dtype(x, compute)), params)

    def build(batch) -> Engine:
        micro = _micro_like(batch, config.grad_accum)
        settings = config.engine_settings()
        program = streamed_program(lambda nest: program_for(loss_fn, params_like, micro, with_rng, nest), tx,
                                   settings, mesh, tuple(partition_rules))
        plan = update_plan(tx, program)
        return Engine(program, source_for(program, plan), tx, settings, mesh, tp_rules=tuple(partition_rules))

    return build


def _compute_dtype(x, compute):
    dtype = jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype
    return compute if jnp.issubdtype(dtype, jnp.floating) else dtype


def _micro_like(batch, grad_accum: int):
    """One micro-batch's abstract leaves: the batch axis divided by ``grad_accum``."""
    def one(x):
        shape = tuple(np.shape(x))
        if not shape:
            return jax.ShapeDtypeStruct((), x.dtype)
        if shape[0] % grad_accum:
            raise BatchError(f"a batch of {shape[0]} rows does not split into grad_accum={grad_accum} micro-batches")
        return jax.ShapeDtypeStruct((shape[0] // grad_accum, *shape[1:]), x.dtype)

    return jax.tree.map(one, batch)


def _check_batch_axis(batch) -> None:
    sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
    if len(sizes) > 1:
        raise BatchError(f"the batch's leaves disagree on the batch axis (leading sizes {sorted(sizes)}); every leaf "
                         "needs the same leading batch size")


def _takes_rng(loss_fn) -> bool:
    """Whether ``loss_fn`` takes a third, rng argument."""
    try:
        params = [p for p in inspect.signature(loss_fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    if len(params) not in (2, 3):
        raise WrapError(f"loss_fn takes {len(params)} arguments; it must be loss_fn(params, batch) or "
                        "loss_fn(params, batch, rng)")
    return len(params) == 3


def _is_abstract(tree) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _checked_state(opt_state, plan):
    """The wrapped state's own optax state, if it is the state ``tx.init`` makes (else refuse: never reset it)."""
    if opt_state is None:
        return None
    if jax.tree_util.tree_structure(opt_state) != plan.state_tree:
        raise WrapError("the state's opt_state does not have the structure of state.tx.init(params); zinfjax keeps "
                        "the optimizer state it is given, so wrap a state whose tx made its opt_state")
    return opt_state


def _is_nnx_optimizer(state) -> bool:
    return isinstance(state, nnx.Optimizer)


def _wrap_nnx(optimizer, config: Config, loss_fn, mesh, model, restore, batch, partition_rules) -> WrappedState:
    if model is None:
        raise WrapError("wrapping an nnx.Optimizer needs its model: zinfjax.wrap(optimizer, config, model=model, "
                        "loss_fn=loss_fn)")
    graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)
    params = params_state.to_pure_dict()
    linen = getattr(model, "module", None)  # nnx.bridge.ToNNX keeps a Linen module here
    if loss_fn is None and isinstance(linen, StackedLM):
        pure_loss, partition_rules = lm_loss(linen), partition_rules or linen.partition_rules
        batch = batch if batch is not None else jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1),
                                                                     jnp.int32)
    elif loss_fn is None:
        raise WrapError("give zinfjax.wrap your loss: wrap(optimizer, config, model=model, loss_fn=loss_fn) with "
                        "loss_fn(model, batch) -> scalar")
    else:
        pure_loss = _nnx_loss(loss_fn, graphdef, params_state, rest)
    step = int(optimizer.step[...])
    tx, opt_state = _trained(optimizer, model, params, _pure(optimizer.opt_state))

    def source_for(program, plan):
        if restore is not None:
            return CheckpointSource(restore, program, plan)
        return TreeSource(program, plan, params, _checked_state(opt_state, plan), step)

    def write_back(new_params) -> None:
        state = nnx.state(model, nnx.Param)
        state.replace_by_pure_dict(new_params)
        nnx.update(model, state)

    build = _builder(pure_loss, params, tx, config, mesh, partition_rules, source_for)
    engine = build(batch) if batch is not None else None
    return WrappedState(build, config, engine.step_count if engine is not None else step, on_sync=write_back,
                        engine=engine)


def _trained(optimizer, model, params: dict, opt_state):
    """The optimizer's transformation and state over every parameter: when its ``wrt`` filter selects some of the
    model's parameters (``nnx.LoRAParam``), ``tx`` on those and no update for the rest (`zinfjax.trainers.frozen`)."""
    wrt = getattr(optimizer, "wrt", nnx.Param)
    chosen = {jax.tree_util.keystr(p) for p, _ in
              jax.tree_util.tree_flatten_with_path(nnx.state(model, wrt).to_pure_dict())[0]}
    every = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    if chosen == every:
        if jax.tree.leaves(nnx.state(model, nnx.LoRAParam).to_pure_dict()):
            raise WrapError("the model has LoRA adapters (nnx.LoRAParam), but the optimizer's wrt filter selects "
                            "every parameter, base included; make it nnx.Optimizer(model, tx, wrt=nnx.LoRAParam) to "
                            "train the adapters alone")
        return optimizer.tx, opt_state
    def trainable(path) -> bool:
        return jax.tree_util.keystr(path) in chosen

    check_selects(params, trainable)
    tx = freeze(optimizer.tx, trainable)
    return tx, carried_state(tx, params, opt_state)


_NNX_LOSSES: dict = {}


def _nnx_loss(loss_fn, graphdef, params_state, rest):
    """``loss(params, batch[, rng])`` over a pure parameter dict, from an NNX ``loss_fn(model, batch[, rng])``."""
    key = (loss_fn, graphdef)
    if key in _NNX_LOSSES:
        return _NNX_LOSSES[key]
    with_rng = _takes_rng(loss_fn)

    def merged(params):
        state = jax.tree.map(lambda x: x, params_state)
        state.replace_by_pure_dict(params)
        return nnx.merge(graphdef, state, rest)

    if with_rng:
        def loss(params, batch, rng):
            return loss_fn(merged(params), batch, rng)
    else:
        def loss(params, batch):
            return loss_fn(merged(params), batch)

    _NNX_LOSSES[key] = loss
    return loss


def _pure(tree):
    """An NNX optimizer state as plain optax state: variables as their values, ``nnx.State`` as dicts."""
    def convert(x):
        if isinstance(x, nnx.Variable):
            return x[...]
        if isinstance(x, nnx.State):
            return {k: convert(v) for k, v in x.items()}
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*[convert(v) for v in x])
        if isinstance(x, tuple | list):
            return type(x)(convert(v) for v in x)
        if isinstance(x, dict):
            return {k: convert(v) for k, v in x.items()}
        return x

    return convert(tree)
