"""A BERT-style masked language model in plain Flax Linen, with an attention mask and dropout, on NVMe.

Nothing here comes from `zinfjax.models`. The loss takes an ``rng`` for dropout: zinfjax gives
each step its key, and each layer of the ``nn.scan`` sees exactly the key the in-memory loop
would give it (``split_rngs={"dropout": True}``). Sequences are byte tokens of the demo corpus,
padded to a fixed length (the attention mask hides the padding), with 15% of the tokens masked.

Run: .venv/bin/python examples/bert_mlm_linen.py [--steps 30]
"""

from __future__ import annotations

import argparse
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import zinfjax
from zinfjax import load_tokens

PAD, MASK = 256, 257


@dataclasses.dataclass(frozen=True)
class BertConfig:
    vocab: int = 258  # bytes, padding, mask
    length: int = 32
    width: int = 64
    depth: int = 4
    heads: int = 4
    mlp: int = 128
    dropout: float = 0.1


class Layer(nn.Module):
    """A post-LayerNorm BERT layer: ``(h, mask) -> (h, mask)``, the `nn.scan` signature with the mask carried along."""

    config: BertConfig

    @nn.compact
    def __call__(self, h, mask):
        c = self.config
        attn = nn.MultiHeadDotProductAttention(num_heads=c.heads, dropout_rate=c.dropout, deterministic=False)
        h = nn.LayerNorm()(h + nn.Dropout(c.dropout, deterministic=False)(attn(h, h, mask=mask)))
        x = nn.Dense(c.width)(nn.gelu(nn.Dense(c.mlp)(h)))
        return nn.LayerNorm()(h + nn.Dropout(c.dropout, deterministic=False)(x)), None


class BertMLM(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, tokens, attention):
        c = self.config
        embed = nn.Embed(c.vocab, c.width, name="word")
        h = embed(tokens) + self.param("positions", nn.initializers.normal(0.02), (1, c.length, c.width))
        h = nn.Dropout(c.dropout, deterministic=False)(nn.LayerNorm(name="embed_norm")(h))
        mask = nn.make_attention_mask(attention, attention)
        layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                         in_axes=nn.broadcast, length=c.depth)
        h, _ = layers(c, name="layers")(h, mask)
        h = nn.LayerNorm(name="mlm_norm")(nn.gelu(nn.Dense(c.width, name="mlm_dense")(h)))
        return embed.attend(h) + self.param("mlm_bias", nn.initializers.zeros, (1, 1, c.vocab))  # tied decoder


def batch_of(config: BertConfig, size: int, seed: int, tokens=None) -> dict:
    """Byte sequences of random lengths, padded; 15% of the real tokens masked; labels -1 where not masked."""
    tokens = load_tokens("demo") if tokens is None else tokens
    rng = np.random.default_rng(seed)
    ids = np.full((size, config.length), PAD, np.int32)
    labels = np.full((size, config.length), -1, np.int32)
    attention = np.zeros((size, config.length), np.int32)
    for k in range(size):
        n = int(rng.integers(config.length // 2, config.length + 1))
        start = int(rng.integers(0, len(tokens) - n))
        ids[k, :n] = tokens[start : start + n]
        attention[k, :n] = 1
        masked = (rng.random(n) < 0.15) | (np.arange(n) == 0)  # at least one per sequence
        labels[k, :n][masked] = ids[k, :n][masked]
        ids[k, :n][masked] = MASK
    return {"tokens": ids, "attention": attention, "labels": labels}


def make_state(config: BertConfig, tx, seed: int = 0):
    model = BertMLM(config)
    example = jnp.zeros((1, config.length), jnp.int32)
    params = model.init({"params": jax.random.key(seed), "dropout": jax.random.key(seed)}, example, example)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def make_loss(state):
    """Mean cross-entropy over the masked tokens; ``rng`` drives dropout."""

    def loss_fn(params, batch, rng):
        logits = state.apply_fn({"params": params}, batch["tokens"], batch["attention"], rngs={"dropout": rng})
        where = batch["labels"] >= 0
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(batch["labels"], 0))
        return jnp.sum(jnp.where(where, losses, 0.0)) / jnp.maximum(jnp.sum(where), 1)

    return loss_fn


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=30)
    args.add_argument("--batch-size", type=int, default=16)
    args.add_argument("--nvme-path", default="runs/example_bert/nvme")
    args = args.parse_args(argv)
    config = BertConfig()
    state = make_state(config, optax.adamw(2e-3))
    run = zinfjax.Config(params="nvme", optimizer="nvme", activations="nvme", nvme_path=args.nvme_path,
                         mesh="data:1", seed=0)
    tokens = load_tokens("demo")
    with zinfjax.wrap(state, run, loss_fn=make_loss(state)) as state:
        for step in range(args.steps):
            state, metrics = state.train_step(batch_of(config, args.batch_size, step, tokens))
            print(f"step {metrics['step']:3d}  masked-token loss {metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
