"""The top level shared by the reference models: embed, ``nn.scan`` over stacked blocks, head."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinfjax.models.configs import ModelConfig
from zinfjax.models.layered import Layers
from zinfjax.program.residuals import keep_products


@functools.cache
def lm_loss(model: nn.Module):
    """``loss(params, tokens)``: the mean next-token loss of ``tokens`` ``(B, T+1)`` (cached: engines share it);
    ``loss(params, tokens, rng)`` for a model with dropout (`takes_rng`: LoRA's ``lora_dropout``).

    Example:
        >>> from zinfjax import models
        >>> model, batch = models.build("gpt2-tiny"), jnp.arange(18).reshape(2, 9) % 7     # (B, T+1) tokens
        >>> params = jax.jit(lm_init(model))(jax.random.key(0))
        >>> loss = jax.jit(lm_loss(model))(params, batch)
        >>> loss.dtype, 5 < float(loss) < 6                               # about ln 256 = 5.5
        (dtype('float32'), True)
    """
    if takes_rng(model):
        def noisy(params, tokens, rng):
            return model.apply({"params": params}, tokens[:, :-1], tokens[:, 1:], rngs={"dropout": rng})

        return noisy

    def loss(params, tokens):
        return model.apply({"params": params}, tokens[:, :-1], tokens[:, 1:])

    return loss


def takes_rng(model: nn.Module) -> bool:
    """Whether the model's training loss takes a dropout key (`lm_loss`)."""
    return bool(getattr(model.config, "lora_rank", 0) and getattr(model.config, "lora_dropout", 0.0))


@functools.cache
def lm_init(model: nn.Module, seq_len: int = 8):
    """``init(rng) -> params``: the model's initialiser (cached per model)."""

    def init(rng):
        return model.init(rng, jnp.zeros((1, seq_len), jnp.int32))["params"]

    return init


class StackedLM(nn.Module):
    """``head(scan(block, embed(tokens)))``; subclasses name their ``Embed``, ``Block`` and ``Head`` modules.

    ``Head`` is called as ``Head(h, embed_params, targets)`` so a tied output projection can read the embedding.
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    # Whole-model differentiation keeps each block's matrix products and recomputes the rest in the
    # backward (``nn.remat`` with `keep_products`), as the engine's saved residuals do: the in-memory
    # trainer's step (zinfjax.trainers.reference.ReferenceTrainer). The streamed layers (`layers`) never use it.
    save_products: bool = False
    parts: ClassVar[tuple[type, type, type]]
    partition_rules: ClassVar[tuple] = ()  # tensor parallelism; see `Layers.partition_rules`
    causal: ClassVar[bool] = True  # a language model that can decode token by token (`decoding`)

    def setup(self):
        embed, block, head = self.parts
        c = self.config
        self.embed = embed(c, self.dtype)
        if self.save_products:
            block = nn.remat(block, policy=keep_products, prevent_cse=False)
        scan = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                       length=c.n_layers)
        self.blocks = scan(c, self.dtype)
        self.head = head(c, self.dtype)

    def __call__(self, tokens: jax.Array, targets: jax.Array | None = None) -> jax.Array:
        h, _ = self.blocks(self.embed(tokens), None)
        return self.head(h, self.embed.variables["params"], targets)

    def layers(self) -> Layers:
        """The embed, block and head functions that zinfjax streams (cached per size)."""
        return _layers(self.parts, self.config, self.dtype, self.partition_rules)

    def decoding(self) -> Decoding | None:
        """The functions that decode with a KV cache (zinfjax.inference), or None for an encoder."""
        return _decoding(self.parts, self.config, self.dtype) if self.causal else None


class Decoding(NamedTuple):
    """Token-by-token decoding of a layered causal LM, one layer at a time.

    - ``embed(p_embed, tokens, offset) -> h`` for tokens at positions ``offset, offset+1, ...``;
    - ``block(p_block_i, h, cache, pos) -> (h, cache)`` attends over and updates the layer's KV cache;
    - ``head(p_head, p_embed, h) -> logits``;
    - ``cache_like(batch, max_len, dtype)``: one layer's empty cache, as ``ShapeDtypeStruct`` leaves.

    Example (a prompt of 3 tokens through layer 0 of gpt2-tiny, its cache room for 16 positions):
        >>> from zinfjax import models
        >>> model, prompt = models.build("gpt2-tiny"), jnp.array([[72, 105, 33]])
        >>> params = jax.jit(lm_init(model))(jax.random.key(0))
        >>> dec = model.decoding()
        >>> zeros_cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), dec.cache_like(1, 16))
        >>> layer_params = jax.tree.map(lambda x: x[0], params["blocks"])
        >>> h, cache = dec.block(layer_params, dec.embed(params["embed"], prompt, 0), zeros_cache, jnp.int32(0))
        >>> h.shape, cache["k"].shape                # (B, T, D); the keys of positions 0-2 written
        ((1, 3, 64), (1, 16, 8, 8))
    """

    embed: Callable
    block: Callable
    head: Callable
    cache_like: Callable


@functools.cache
def _decoding(parts: tuple[type, type, type], c: ModelConfig, dt) -> Decoding:
    embed, block, head = parts

    def cache_like(batch: int, max_len: int, dtype=dt):
        shape = (batch, max_len, c.kv_heads, c.head_dim)
        return {"k": jax.ShapeDtypeStruct(shape, dtype), "v": jax.ShapeDtypeStruct(shape, dtype)}

    return Decoding(
        embed=lambda p, tokens, offset: embed(c, dt).apply({"params": p}, tokens, offset),
        block=lambda p, h, cache, pos: block(c, dt).apply({"params": p}, h, None, cache=cache, pos=pos),
        head=lambda ph, pe, h: head(c, dt).apply({"params": ph}, h, pe, None),
        cache_like=cache_like,
    )


@functools.cache
def _layers(parts: tuple[type, type, type], c: ModelConfig, dt, rules: tuple) -> Layers:
    embed, block, head = parts
    return Layers(
        embed=lambda p, tokens: embed(c, dt).apply({"params": p}, tokens),
        block=lambda p, h: block(c, dt).apply({"params": p}, h)[0],
        head=lambda ph, pe, h, targets: head(c, dt).apply({"params": ph}, h, pe, targets),
        partition_rules=rules,
    )
