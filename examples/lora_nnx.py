"""LoRA on your own NNX model, streamed with zinfjax: Flax's `nnx.LoRALinear` in scanned blocks, the optimizer on
`nnx.LoRAParam` alone. zinfjax trains the adapters, never updates nor writes the base (docs/models.md, "LoRA").

Run: .venv/bin/python examples/lora_nnx.py --steps 20 --nvme-path runs/example_lora/nvme
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zinfjax
from zinfjax import Batches, load_tokens

LAYERS, D, VOCAB = 4, 64, 256


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.LoRALinear(D, 4 * D, lora_rank=8, rngs=rngs)  # a frozen kernel, a trainable adapter
        self.down = nnx.LoRALinear(4 * D, D, lora_rank=8, rngs=rngs)

    def __call__(self, h):
        return h + self.down(nnx.gelu(self.up(self.norm(h))))


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return Block(rngs)

        self.blocks = blocks(rngs)  # stacked on a layer axis: zinfjax streams them one layer at a time
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, h):
            return block(h)

        return self.head(run(self.blocks, self.embed(tokens)))


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nvme-path", default="runs/example_lora/nvme")
    args = p.parse_args()
    model = LM(nnx.Rngs(0))
    base = jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict()["blocks"]["up"]["kernel"])
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)  # the adapters train, the rest is frozen
    config = zinfjax.Config(batch_size=8, seq_len=64, params="nvme", optimizer="nvme", nvme_path=args.nvme_path)
    state = zinfjax.wrap(optimizer, config, model=model, loss_fn=loss_fn)
    batches = Batches(load_tokens("demo"), config.batch_size, config.seq_len, seed=0)
    for _ in range(args.steps):
        state, metrics = state.train_step(jnp.asarray(next(batches)))
        print(f"step {metrics['step']:3d}  loss {metrics['loss']:.4f}  written {metrics['write_bytes_nvme']} bytes")
    state.sync()  # the trained adapters back in the NNX model
    state.close()
    kernel = nnx.state(model, nnx.Param).to_pure_dict()["blocks"]["up"]["kernel"]
    print(f"base kernel unchanged: {bool(np.array_equal(np.asarray(kernel), base))}")


if __name__ == "__main__":
    main()
