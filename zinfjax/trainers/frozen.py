"""Frozen parameters: an optimizer that trains some leaves and gives the rest no update at all.

Flax says which parameters train in its own ways: an ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``
keeps optimizer state for the ``wrt`` leaves alone. zinfjax streams the whole model, so it runs ``tx``
on those leaves through ``optax.multi_transform`` and gives every other leaf ``optax.set_to_zero()``: the
same updates, the frozen leaves bit for bit unchanged (`freeze`). The user's optimizer state, made by
``tx.init`` on the trainable leaves alone, is carried into the transformation's state (`carried_state`):
it holds the same leaves in the same order.

LoRA on zinfjax's own models uses the same transformation, with `zinfjax.models.lora.is_adapter` as the
selection (`zinfjax.trainers.optimizers.make_optimizer`).

Example:
    >>> import jax.numpy as jnp
    >>> params = {"q": jnp.ones((4, 4)), "q_lora": {"a": jnp.ones((4, 2)), "b": jnp.zeros((2, 4))}}
    >>> tx = freeze(optax.adam(1e-3), lambda path: "lora" in jax.tree_util.keystr(path))
    >>> state = carried_state(tx, params, optax.adam(1e-3).init({"q_lora": params["q_lora"]}))
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> float(jnp.abs(updates["q"]).max()), round(float(updates["q_lora"]["a"][0, 0]), 5)   # q frozen, the adapter not
    (0.0, -0.001)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from zinfjax.errors import UserError

TRAIN, FROZEN = "train", "frozen"


class FrozenError(UserError):
    """A trainable selection that selects nothing, or a state that is not the trainable leaves'."""


class SelectionTypeError(FrozenError, TypeError):
    """``trainable(path, leaf)`` answered something other than True or False."""


def labels(params, trainable: Callable) -> Any:
    """``params`` with each leaf replaced by ``"train"`` or ``"frozen"``, as ``trainable(key path)`` says."""
    return jax.tree_util.tree_map_with_path(lambda p, _: TRAIN if trainable(p) else FROZEN, params)


def freeze(tx: optax.GradientTransformation, trainable: Callable) -> optax.GradientTransformation:
    """``tx`` on the leaves whose key path ``trainable`` selects, no update for the others (``optax.set_to_zero``)."""
    return optax.multi_transform({TRAIN: tx, FROZEN: optax.set_to_zero()}, lambda params: labels(params, trainable))


def by_path(trainable: Callable[[str, Any], bool], params) -> Callable:
    """A key-path selection from a user's ``trainable(path, leaf) -> bool``, ``path`` as ``"blocks/q_lora/a"``.

    Raises:
        FrozenError: it selects no parameter, or every one (then nothing is frozen: leave ``trainable`` out).
    """
    chosen = set()
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keypath)
        if _answer(trainable(path, leaf), path):
            chosen.add(jax.tree_util.keystr(keypath))
    total = len(jax.tree.leaves(params))
    if not chosen:
        raise FrozenError("trainable= selects no parameter of the model; nothing would train (it is called as "
                          "trainable(path, leaf) with paths like 'blocks/q_lora/a')")
    if len(chosen) == total:
        raise FrozenError(f"trainable= selects every one of the {total} parameters, so nothing is frozen; leave "
                          "trainable out to train them all, or select fewer")
    return lambda keypath: jax.tree_util.keystr(keypath) in chosen


def _answer(answer, path: str) -> bool:
    """``trainable``'s answer for ``path``: True or False (numpy's bools too); anything else, a string or a number
    that is merely truthy, is refused rather than guessed at."""
    if not isinstance(answer, bool | np.bool_):
        shown = repr(answer)
        shown = shown if len(shown) <= 40 and "\n" not in shown else f"a {type(answer).__name__}"
        raise SelectionTypeError(f"trainable(path, leaf) must return True or False; for {path!r} it returned "
                                 f"{shown} ({type(answer).__name__})")
    return bool(answer)


def check_selects(params, trainable: Callable) -> None:
    """Refuses a selection that holds no leaf of ``params``.

    Raises:
        FrozenError: nothing would train.
    """
    if TRAIN not in jax.tree.leaves(labels(params, trainable)):
        raise FrozenError("the trainable selection (the optimizer's wrt filter) selects no parameter of the model; "
                          "nothing would train")


def carried_state(frozen_tx: optax.GradientTransformation, params, state):
    """``state`` (``tx.init`` of the trainable leaves alone) as the state of ``frozen_tx`` (`freeze`) on ``params``.

    Raises:
        FrozenError: ``state`` does not hold the leaves ``frozen_tx`` keeps, in shape and order.
    """
    like = jax.eval_shape(frozen_tx.init, params)
    want, tree = jax.tree_util.tree_flatten(like)
    have = jax.tree.leaves(state)
    shapes = [tuple(x.shape) for x in want], [tuple(getattr(x, "shape", ())) for x in have]
    if shapes[0] != shapes[1]:
        raise FrozenError(f"the optimizer state holds {len(have)} leaves of shapes {shapes[1][:4]}..., not the "
                          f"{len(want)} of the trainable parameters' ({shapes[0][:4]}...); wrap the optimizer that "
                          "made it")
    return jax.tree_util.tree_unflatten(tree, have)
