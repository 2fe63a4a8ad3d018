"""The layered convention: a model split into embed, one block, and head+loss.

zinfjax streams a model one layer at a time, so it needs the model as three pure
functions over three parameter groups:

- ``params["embed"]``: used by ``embed(p_embed, tokens) -> h``;
- ``params["blocks"]``: every leaf stacked on a leading layer axis ``(L, ...)``
  (the ``nn.scan`` layout); ``block(p_block_i, h) -> h`` takes one layer's slice;
- ``params["head"]``: used by ``head(p_head, p_embed, h, targets) -> loss``. The head
  also receives the embedding group so that a tied output projection can read it.

A model follows the convention when it has a ``layers()`` method returning `Layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from zinfjax._util.choices import GROUPS
from zinfjax.errors import UserError
from zinfjax.models.products import accumulator

Params = Any
DOCS = "the docstring of zinfjax.models.layered"


class Layers(NamedTuple):
    """The three functions of a layered model.

    Example:
        >>> from zinfjax.models import GPT, ModelConfig
        >>> model, tokens = GPT(ModelConfig.named("gpt2-tiny")), jnp.zeros((2, 8), jnp.int32)
        >>> params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        >>> layers = model.layers()
        >>> h = layers.embed(params["embed"], tokens)
        >>> h = layers.block(jax.tree.map(lambda x: x[0], params["blocks"]), h)     # layer 0
        >>> h.shape
        (2, 8, 64)
    """

    embed: Callable[[Params, jax.Array], jax.Array]
    block: Callable[[Params, jax.Array], jax.Array]
    head: Callable[[Params, Params, jax.Array, jax.Array], jax.Array]
    # Tensor parallelism: ``(path pattern, per-layer spec)`` pairs, e.g. ``("fc/kernel", (None, "model"))``.
    # A pattern matches the end of a leaf's path (``blocks/fc/kernel``); unmatched leaves are not split
    # over the ``model`` axis. See zinfjax/sharding.py and docs/sharding.md.
    partition_rules: tuple = ()


@runtime_checkable
class LayeredModel(Protocol):
    """A model that can be streamed: it returns its `Layers`."""

    def layers(self) -> Layers: ...


class LayeredConventionError(UserError):
    """The model or its parameters do not follow the layered convention."""


def check_params(params: Params) -> int:
    """Checks the parameter groups and returns the number of layers L.

    Example:
        >>> e, h = {"wte": jnp.zeros((256, 64))}, {"scale": jnp.ones(64)}
        >>> check_params({"embed": e, "blocks": {"w": jnp.zeros((12, 64, 64))}, "head": h})
        12
        >>> check_params({"embed": e, "blocks": {"w": jnp.zeros((12, 64)), "b": jnp.zeros((6, 64))}, "head": h})
        Traceback (most recent call last):
        zinfjax.models.layered.LayeredConventionError: every leaf of params['blocks'] must be stacked on a leading ...
    """
    if not isinstance(params, dict) or set(params) != set(GROUPS):
        keys = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise LayeredConventionError(
            f"params must have exactly the groups {list(GROUPS)}, got {keys}; see {DOCS}"
        )
    leaves = jax.tree.leaves(params["blocks"])
    if not leaves:
        raise LayeredConventionError(f"params['blocks'] has no arrays; see {DOCS}")
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise LayeredConventionError(
            f"every leaf of params['blocks'] must be stacked on a leading layer axis of one length; "
            f"got leading sizes {sorted(map(str, sizes))}; see {DOCS}"
        )
    return sizes.pop()


def get_layers(model: Any) -> Layers:
    """Returns the model's `Layers`, or raises an error naming what is missing.

    Example:
        >>> from zinfjax.models import GPT, ModelConfig
        >>> layers = get_layers(GPT(ModelConfig.named("gpt2-tiny")))
        >>> get_layers(object())
        Traceback (most recent call last):
        zinfjax.models.layered.LayeredConventionError: object does not follow the layered convention: it needs ...
    """
    if not isinstance(model, LayeredModel):
        raise LayeredConventionError(
            f"{type(model).__name__} does not follow the layered convention: it needs a "
            f"layers() method returning zinfjax.models.Layers(embed, block, head); see {DOCS}"
        )
    layers = model.layers()
    if not isinstance(layers, Layers):
        raise LayeredConventionError(f"{type(model).__name__}.layers() must return Layers; see {DOCS}")
    return layers


def stacked_blocks(path: str) -> bool:
    """Whether the leaf at ``path`` (`zinfjax.sharding.path_str`'s ``a/b/c``) is stacked on a layer axis: under
    ``blocks/``, as the convention stacks them.

    Example:
        >>> stacked_blocks("blocks/fc/kernel"), stacked_blocks("embed/wte/embedding")
        (True, False)
    """
    return path.startswith("blocks/")


def layer_slice(blocks: Params, i: int) -> Params:
    """Layer ``i`` of the stacked block parameters."""
    return jax.tree.map(lambda x: x[i], blocks)


def scan_blocks(block: Callable, blocks: Params, h: jax.Array) -> jax.Array:
    """Runs every block in order with ``lax.scan``: the in-memory composition."""

    def body(carry, p):
        return block(p, carry), None

    return jax.lax.scan(body, h, blocks)[0]


def loss_fn(layers: Layers, params: Params, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """The full model loss: ``head(scan(block, embed(x)))``.

    Example (the same loss as the model's own apply):
        >>> from zinfjax.models import GPT, ModelConfig
        >>> model, batch = GPT(ModelConfig.named("gpt2-tiny")), jnp.arange(18).reshape(2, 9) % 7
        >>> params = jax.jit(model.init)(jax.random.key(0), batch[:, :-1])["params"]
        >>> loss = jax.jit(loss_fn, static_argnums=0)(model.layers(), params, batch[:, :-1], batch[:, 1:])
        >>> applied = jax.jit(model.apply)({"params": params}, batch[:, :-1], batch[:, 1:])
        >>> bool(jnp.allclose(loss, applied))
        True
    """
    h = layers.embed(params["embed"], tokens)
    h = scan_blocks(layers.block, params["blocks"], h)
    return layers.head(params["head"], params["embed"], h, targets)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy, computed in float32 (or the logits' own dtype where it is wider)."""
    logits = logits.astype(accumulator(logits.dtype))
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)
