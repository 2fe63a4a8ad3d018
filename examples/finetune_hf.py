"""Fine-tune a Hugging Face model with its parameters and Adam state on NVMe, then hand it back to transformers.

1. ``convert``: the HF directory becomes a zinfjax checkpoint (fp32 weights and a fresh adamw state), one
   tensor at a time.
2. ``zinfjax.wrap(..., restore=...)``: a Flax TrainState trains from it with params=nvme, optimizer=nvme.
3. A `CheckpointManager` saves the fine-tuned state; ``convert --to hf`` writes it back as safetensors,
   and transformers loads it and scores the held-out text better than the model it started from.

Run:
    .venv/bin/python examples/finetune_hf.py                         # a small GPT-2 built by transformers
    .venv/bin/python examples/finetune_hf.py --model path/to/hf-dir  # your GPT-2, Llama (byte ids < vocab)

Without ``--model`` the starting model is a GPT-2 built by transformers from a config with random
weights (nothing is downloaded); the text is the byte-level demo corpus that ships with zinfjax.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import numpy as np

import zinfjax
from zinfjax import Batches, load_tokens


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__[__doc__.index("Run:"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face model directory (default: build a small GPT-2)")
    p.add_argument("--out", default="runs/finetune_hf", help="working directory (default: runs/finetune_hf)")
    p.add_argument("--steps", type=int, default=40, help="fine-tuning steps (default: 40)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def small_gpt2(directory: str) -> str:
    """A GPT-2 with a byte vocabulary and random weights, saved by transformers as a pretrained model is."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def torch_loss(hf_dir: str, batch: np.ndarray) -> float:
    """The mean next-token loss that transformers computes for ``batch`` with the model in ``hf_dir``."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.tensor(batch, dtype=torch.long)
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


def finetune(ckpt_dir: str, args) -> dict:
    """Trains from the newest checkpoint in ``ckpt_dir`` with NVMe offload and saves the result there."""
    import jax
    import jax.numpy as jnp
    from flax.training import train_state
    from tqdm import tqdm

    from zinfjax import make_optimizer, models
    from zinfjax.checkpoint import CheckpointManager, read_meta
    from zinfjax.checkpoint.model import checkpoint_model

    path, model_config = checkpoint_model(ckpt_dir)
    config = zinfjax.Config(batch_size=args.batch_size, seq_len=args.seq_len, lr=read_meta(path)["config"]["lr"],
                            params="nvme", optimizer="nvme", nvme_path=os.path.join(args.out, "nvme"))
    model, tx = models.build(model_config), make_optimizer(config.replace(grad_clip=0.0))

    def create():
        params = model.init(jax.random.key(0), jnp.zeros((1, config.seq_len), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    # Shapes only: the parameters and the optimizer state come from the checkpoint, straight to NVMe.
    state = jax.eval_shape(create)
    batches = Batches(load_tokens("demo"), config.batch_size, config.seq_len, seed=1)
    tokens_per_step = config.batch_size * config.seq_len
    with zinfjax.wrap(state, config, restore=ckpt_dir) as wrapped:
        bar = tqdm(range(args.steps), desc="fine-tune", unit="step", dynamic_ncols=True)
        losses, start = [], time.perf_counter()
        for _ in bar:
            wrapped, m = wrapped.train_step(next(batches))
            losses.append(m["loss"])
            rate = tokens_per_step * len(losses) / (time.perf_counter() - start)
            read, written = m["read_bytes_nvme"] / 2**20, m["write_bytes_nvme"] / 2**20
            bar.set_postfix_str(f"loss {m['loss']:.3f}, {rate:.0f} tok/s, nvme read {read:.1f} MiB, "
                                f"written {written:.1f} MiB")
        manager = CheckpointManager(ckpt_dir, config=config, model=model_config)
        manager.save(wrapped, data_position=batches.position)
        manager.wait()
        manager.close()
    return {"losses": losses, "step": wrapped.step}


def main(argv=None) -> int:
    args = parse_args(argv)
    from zinfjax_interop.convert import convert

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    hf_dir = args.model or small_gpt2(os.path.join(args.out, "hf-base"))
    ckpt_dir, back_dir = os.path.join(args.out, "ckpt"), os.path.join(args.out, "hf-finetuned")

    held_out = np.asarray(Batches(load_tokens("demo"), 4, args.seq_len, seed=12345).batch(0)[:, :-1])
    before = torch_loss(hf_dir, held_out)

    summary = convert(hf_dir, ckpt_dir, lr=args.lr, progress=True)
    print(f"converted {hf_dir}: {summary['tensors']} tensors, {summary['bytes'] / 2**20:.1f} MiB (params and adamw "
          f"state) -> {summary['path']}")
    result = finetune(ckpt_dir, args)
    print(f"fine-tuned {result['step']} steps with params and optimizer state on NVMe: loss "
          f"{result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}")

    summary = convert(ckpt_dir, back_dir, to="hf", progress=True)
    after = torch_loss(back_dir, held_out)
    print(f"exported step {summary['step']} to {back_dir} ({summary['tensors']} tensors, {summary['dtype']})")
    print(f"transformers, held-out loss: {before:.4f} before, {after:.4f} after fine-tuning")
    return 0 if after < before else 1


if __name__ == "__main__":
    sys.exit(main())
