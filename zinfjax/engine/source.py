"""Where an engine's initial state comes from, one unit (a layer, a row chunk, a whole group) at a time.

A source gives, for each unit of each group, its parameters in store layout, and optionally its
optimizer state and the global optimizer state; what it does not give, the engine initialises
with the optimizer's own ``init``. Sources: whole trees in memory (`TreeSource`), a checkpoint
(`zinfjax.checkpoint.CheckpointSource`), or an initialiser run one layer at a time
(`zinfjax.program.init.InitSource`), so a model larger than memory never exists whole.

Example:
    >>> import optax
    >>> from zinfjax.engine import update_plan
    >>> from zinfjax.program import program_for
    >>> def loss_fn(params, x):                   # four layers: a scan over their stacked weights and biases
    ...     layer = lambda h, p: (jnp.tanh(h @ p["w"] + p["b"][None]), None)
    ...     return jnp.mean(jax.lax.scan(layer, x, params["blocks"])[0] ** 2)
    >>> params = {"blocks": {"b": jnp.zeros((4, 64)), "w": jnp.ones((4, 64, 64))}}
    >>> program, tx = program_for(loss_fn, params, jnp.ones((8, 64))), optax.adam(1e-3)
    >>> source = TreeSource(program, update_plan(tx, program), params, opt_state=tx.init(params), step=10)
    >>> source.params("s:blocks", 3)[0].shape       # layer 3 of the first leaf of the blocks group
    (64,)
    >>> source.step
    10
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.program.split import store_slice


@runtime_checkable
class Source(Protocol):
    """What an engine starts from: each unit's parameters, optionally its optimizer state and the global state,
    the step count, and fp16's loss scale (None: start the scale afresh).

    Implemented by `TreeSource`, `zinfjax.checkpoint.CheckpointSource` and `zinfjax.program.init.InitSource`.
    """

    step: int
    loss_scale: float | None
    loss_scale_good: int

    def params(self, group: str, i: int, only: frozenset | None = None) -> list:
        """Unit ``i`` of ``group``: its leaves in store layout (None for those ``only``, a set of paths, leaves out:
        a source computes or reads no more than it is asked for)."""

    def state(self, group: str, i: int) -> list | None:
        """Unit ``i``'s optimizer state, or None for the optimizer's own ``init``."""

    def globals(self) -> list | None:
        """The optimizer's global state (a step count, a schedule's), or None for ``init``'s."""


class TreeSource:
    """Initial parameters, and optionally the optimizer state, from whole trees.

    ``opt_state`` is the optax state of the whole tree (``tx.init(params)`` or one trained in
    memory); the engine then starts from it instead of a fresh ``init``, and ``step`` is kept.
    """

    def __init__(self, program, plan, params, opt_state=None, step: int = 0):
        self.program, self.plan, self.step = program, plan, int(step)
        self._params = program.params_tree.flatten_up_to(params)
        self._state = None if opt_state is None else plan.state_tree.flatten_up_to(opt_state)
        self.loss_scale, self.loss_scale_good = None, 0

    def params(self, group: str, i: int, only: frozenset | None = None) -> list:
        return [store_slice(leaf, self._params[leaf.index], i) if only is None or leaf.path in only else None
                for leaf in self.program.leaves_of(group)]

    def state(self, group: str, i: int) -> list | None:
        if self._state is None:
            return None
        return [store_slice(self.program.leaves[s.param], self._state[s.index], i) for s in self.plan.state_of(group)]

    def globals(self) -> list | None:
        if self._state is None:
            return None
        return [jnp.asarray(self._state[s.index]) for s in self.plan.globals]


def abstract(tree):
    """``tree`` as ``ShapeDtypeStruct`` leaves."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
