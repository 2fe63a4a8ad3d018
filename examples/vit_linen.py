"""A ViT image classifier in plain Flax Linen, trained with its state on NVMe through `zinfjax.wrap`.

Nothing here comes from `zinfjax.models`: the model is a Flax user's own (a patch-embedding
convolution, a class token, learned positions, `nn.scan` blocks, a classification head). The
only zinfjax lines are the `wrap` and the step call.

The task is synthetic and learnable: each image is noise plus a bright square in one of four
quadrants, and the label is the quadrant.

Run: .venv/bin/python examples/vit_linen.py [--steps 30] [--size small]
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


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    image: int = 32
    patch: int = 8
    channels: int = 3
    width: int = 64
    depth: int = 4
    heads: int = 4
    mlp: int = 128
    classes: int = 4


SIZES = {
    "tiny": ViTConfig(),
    "small": ViTConfig(image=64, patch=8, width=256, depth=6, heads=8, mlp=1024),
    "base": ViTConfig(image=224, patch=16, width=768, depth=12, heads=12, mlp=3072, classes=1000),  # ViT-B/16
}


class Block(nn.Module):
    """A pre-LayerNorm transformer block with the `nn.scan` signature ``(h, _) -> (h, None)``."""

    config: ViTConfig

    @nn.compact
    def __call__(self, h, _):
        c = self.config
        x = nn.LayerNorm()(h)
        h = h + nn.MultiHeadDotProductAttention(num_heads=c.heads, qkv_features=c.width)(x, x)
        x = nn.LayerNorm()(h)
        x = nn.Dense(c.width)(nn.gelu(nn.Dense(c.mlp)(x)))
        return h + x, None


class ViT(nn.Module):
    config: ViTConfig

    @nn.compact
    def __call__(self, images):
        c = self.config
        x = nn.Conv(c.width, (c.patch, c.patch), strides=(c.patch, c.patch), name="patches")(images)
        x = x.reshape(x.shape[0], -1, c.width)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c.width))
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, c.width)), x], axis=1)
        x = x + self.param("positions", nn.initializers.normal(0.02), (1, x.shape[1], c.width))
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.depth)
        x, _ = blocks(c, name="blocks")(x, None)
        return nn.Dense(c.classes, name="head")(nn.LayerNorm(name="norm")(x[:, 0]))


def batch_of(config: ViTConfig, size: int, seed: int) -> dict:
    """Noise plus a bright square in one quadrant; the label is the quadrant."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, size)
    images = rng.normal(0, 1, (size, config.image, config.image, config.channels)).astype(np.float32)
    half, side = config.image // 2, config.image // 4
    for k, q in enumerate(labels):
        y, x = (q // 2) * half + side // 2, (q % 2) * half + side // 2
        images[k, y : y + side, x : x + side] += 3.0
    return {"image": images, "label": labels.astype(np.int32) % config.classes}


def make_state(config: ViTConfig, tx, seed: int = 0, abstract: bool = False):
    """The TrainState (and init_fn) a Flax user would write."""
    model = ViT(config)
    example = jnp.zeros((1, config.image, config.image, config.channels))
    init_fn = lambda rng: model.init(rng, example)["params"]  # noqa: E731
    params = jax.eval_shape(init_fn, jax.random.key(seed)) if abstract else init_fn(jax.random.key(seed))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx), init_fn


def make_loss(state):
    """The loss a Flax user passes to jax.grad: label cross-entropy."""

    def loss_fn(params, batch):
        logits = state.apply_fn({"params": params}, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    return loss_fn


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=30)
    args.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args.add_argument("--batch-size", type=int, default=16)
    args.add_argument("--nvme-path", default="runs/example_vit/nvme")
    args = args.parse_args(argv)
    config = SIZES[args.size]
    state, init_fn = make_state(config, optax.adamw(1e-3, weight_decay=0.01), abstract=True)
    run = zinfjax.Config(params="nvme", optimizer="nvme", activations="nvme", nvme_path=args.nvme_path,
                         mesh="data:1")
    with zinfjax.wrap(state, run, loss_fn=make_loss(state), init_fn=init_fn) as state:  # initialised layer by layer
        for step in range(args.steps):
            state, metrics = state.train_step(batch_of(config, args.batch_size, step))
            print(f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}  "
                  f"nvme read {metrics['read_bytes_nvme'] / 2**20:.1f} MiB  stall {metrics['stall_s']:.3f}s")


if __name__ == "__main__":
    main()
