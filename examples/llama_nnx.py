"""A Llama-style decoder in plain Flax NNX (`nnx.vmap`-made blocks run by `nnx.scan`), trained on NVMe.

Nothing here comes from `zinfjax.models`: RMSNorm, rotary positions, grouped-query attention and a
SwiGLU MLP, written as an NNX user would. An `nnx.Optimizer` does not hold its model, so `wrap`
takes the model too, and the loss takes the model as its first argument.

Run: .venv/bin/python examples/llama_nnx.py [--steps 30]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zinfjax
from zinfjax import Batches, load_tokens


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    width: int = 64
    depth: int = 4
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 128


def rotate(x, theta: float = 10000.0):
    """Rotary position embedding on (B, T, H, D), rotate-half layout."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None]
    angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * jnp.cos(angles) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(angles)


class Block(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        hd = c.width // c.heads
        self.c, self.hd = c, hd
        self.attn_norm, self.mlp_norm = nnx.RMSNorm(c.width, rngs=rngs), nnx.RMSNorm(c.width, rngs=rngs)
        self.q = nnx.Linear(c.width, c.heads * hd, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(c.width, 2 * c.kv_heads * hd, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(c.heads * hd, c.width, use_bias=False, rngs=rngs)
        self.gate_up = nnx.Linear(c.width, 2 * c.mlp, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(c.mlp, c.width, use_bias=False, rngs=rngs)

    def __call__(self, h):
        c, hd = self.c, self.hd
        b, t, _ = h.shape
        x = self.attn_norm(h)
        q = rotate(self.q(x).reshape(b, t, c.heads, hd))
        k, v = jnp.split(self.kv(x).reshape(b, t, 2 * c.kv_heads, hd), 2, axis=2)
        k = jnp.repeat(rotate(k), c.heads // c.kv_heads, axis=2)
        v = jnp.repeat(v, c.heads // c.kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, -1)
        h = h + self.out(a)
        gate, up = jnp.split(self.gate_up(self.mlp_norm(h)), 2, axis=-1)
        return h + self.down(nnx.silu(gate) * up)


class Llama(nnx.Module):
    def __init__(self, c: LlamaConfig, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab, c.width, rngs=rngs)

        @nnx.split_rngs(splits=c.depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(c, rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.RMSNorm(c.width, rngs=rngs)
        self.head = nnx.Linear(c.width, c.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, h):
            return block(h)

        return self.head(self.norm(run(self.blocks, self.embed(tokens))))


def loss_fn(model: Llama, batch):
    """Next-token cross-entropy of (B, T+1) tokens."""
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=30)
    args.add_argument("--batch-size", type=int, default=8)
    args.add_argument("--seq-len", type=int, default=64)
    args.add_argument("--nvme-path", default="runs/example_llama_nnx/nvme")
    args = args.parse_args(argv)
    model = Llama(LlamaConfig(), nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    run = zinfjax.Config(params="nvme", optimizer="nvme", nvme_path=args.nvme_path, mesh="data:1")
    batches = Batches(load_tokens("demo"), args.batch_size, args.seq_len, seed=0)
    with zinfjax.wrap(optimizer, run, model=model, loss_fn=loss_fn) as state:
        for _ in range(args.steps):
            state, metrics = state.train_step(next(batches))
            print(f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}")
        state.sync()  # the trained parameters back in the NNX model


if __name__ == "__main__":
    main()
