"""LoRA adapters for the reference models: ``W x + (alpha / r) B A x`` beside a projection, the base frozen.

A block's targeted projections (``lora_targets``: any of q, k, v, o, up, gate, down) each get an
adapter of rank ``r`` (`ModelConfig.lora_rank`) under ``<projection>_lora``: ``a`` ``(in..., r)``,
initialised as PEFT initialises ``lora_A`` (Kaiming-uniform, bound ``1 / sqrt(in)``), and ``b``
``(r, out...)``, zeros, so a fresh adapter leaves the model as it was. The adapters are parameters of
the block, stacked per layer like the rest, so they stream with their layer. The optimizer trains
them alone (`is_adapter` selects them for `zinfjax.trainers.frozen.freeze`): every other leaf gets no
update (``optax.set_to_zero``).

Example:
    >>> from zinfjax import models
    >>> c = models.ModelConfig.named("llama-tiny").replace(lora_rank=4, lora_targets=("q", "v"))
    >>> params = jax.eval_shape(models.build(c).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    >>> jax.tree.map(jnp.shape, params["blocks"]["q_lora"])          # 4 layers of q's adapter: (in, r), (r, out)
    {'a': (4, 128, 4), 'b': (4, 4, 16, 8)}
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinfjax.errors import ConfigError

TARGETS = ("q", "k", "v", "o", "up", "gate", "down")
SUFFIX = "_lora"
# zinfjax's module name of each target, per architecture.
MODULES = {
    "gpt2": {"q": "q", "k": "k", "v": "v", "o": "attn_out", "up": "fc", "down": "proj"},
    "llama": {"q": "q", "k": "k", "v": "v", "o": "attn_out", "gate": "gate", "up": "up", "down": "down"},
}


def check_targets(arch: str, targets: tuple[str, ...]) -> None:
    """LoRA targets that name projections of ``arch``; the error lists the names there are.

    Example:
        >>> check_targets("gpt2", ("q", "gate"))
        Traceback (most recent call last):
        ...
        zinfjax.errors.ConfigError: lora_targets=q,gate: gpt2 has no gate; its projections are q, k, v, o, up, down
    """
    names = MODULES.get(arch)
    if names is None:
        raise ConfigError(f"LoRA adapts the gpt2 and llama models; {arch} has none")
    bad = [t for t in targets if t not in names]
    if bad or not targets:
        missing = ", ".join(bad) if bad else "nothing"
        raise ConfigError(f"lora_targets={','.join(targets)}: {arch} has no {missing}; its projections are "
                          f"{', '.join(names)}")


def _a_init(n_in: int):
    bound = 1.0 / math.sqrt(n_in)  # PEFT: kaiming_uniform_(lora_A.weight, a=sqrt(5)) on (r, in)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRA(nn.Module):
    """The adapter of one projection: ``(alpha / rank) * (dropout(x) A) B`` over ``x``'s last ``in_axes`` axes.

    Dropout (``rate``, PEFT's ``lora_dropout``) applies while training: when the model is applied with a
    ``dropout`` rng (`zinfjax.models.stacked.lm_loss`); evaluation and generation pass none.
    """

    features: tuple[int, ...]
    rank: int
    alpha: float
    in_axes: int = 1
    dtype: Any = jnp.float32
    rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.rate:
            x = nn.Dropout(self.rate, deterministic=not self.has_rng("dropout"))(x)
        in_shape = x.shape[-self.in_axes:]
        a = self.param("a", _a_init(math.prod(in_shape)), (*in_shape, self.rank))
        b = self.param("b", nn.initializers.zeros_init(), (self.rank, *self.features))
        dims = ((tuple(range(x.ndim - self.in_axes, x.ndim)), tuple(range(self.in_axes))), ((), ()))
        low = jax.lax.dot_general(x.astype(self.dtype), a.astype(self.dtype), dims)
        out = jax.lax.dot_general(low, b.astype(self.dtype), (((low.ndim - 1,), (0,)), ((), ())))
        return out * jnp.asarray(self.alpha / self.rank, self.dtype)


def adapted(config, target: str, y: jax.Array, x: jax.Array, features, in_axes: int = 1, dtype=jnp.float32):
    """``y``, the output of the projection ``target`` on ``x``, plus its adapter when ``config`` targets it."""
    if not config.lora_rank or target not in config.lora_targets:
        return y
    name = MODULES[config.arch][target] + SUFFIX
    features = tuple(features) if isinstance(features, tuple) else (features,)
    adapter = LoRA(features, config.lora_rank, config.lora_alpha, in_axes, dtype, config.lora_dropout, name=name)
    return y + adapter(x).astype(y.dtype)


def is_adapter(path) -> bool:
    """Whether a parameter path (a jax key path, or its keys) is a LoRA adapter's."""
    keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    return any(isinstance(k, str) and k.endswith(SUFFIX) for k in keys)
