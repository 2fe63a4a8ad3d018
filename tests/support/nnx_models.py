"""An NNX language model whose blocks stream: made by ``nnx.vmap`` (stacked on a layer axis), run by ``nnx.scan``.

The tests' NNX models differ only in their block (a tiled MLP, Flax's LoRA layers...): `StackedLM` takes it.
"""

from __future__ import annotations

from collections.abc import Callable

import optax
from flax import nnx


class StackedLM(nnx.Module):
    """``embed``, ``layers`` blocks made by ``make_block(rngs)`` and run in turn, ``head``."""

    def __init__(self, make_block: Callable, layers: int, vocab: int, d: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return make_block(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, h):
            return block(h)

        return self.head(run(self.blocks, self.embed(tokens)))


def next_token_loss(model, batch):
    """Mean cross-entropy of ``model`` predicting ``batch[:, 1:]`` from ``batch[:, :-1]``."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
