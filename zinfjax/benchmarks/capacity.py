"""Capacity benchmark: train a model whose state is many times the memory the process may use.

It sizes a GPT-2-style model whose training state (fp32 parameters plus Adam's m and v: 12 bytes
per parameter) is at least ``--state-bytes``, writes its `ModelConfig` to a file, and trains it
with ``zinfjax train`` (the user's path: layer-by-layer initialisation straight into the NVMe
tier, the memory budget, every tier on NVMe) in a fresh process inside a memory cgroup (v1)
limited to ``--memory-limit``. Page cache counts against the limit too, so the state streams
from the disk.

AdamW runs at a small learning rate (1e-6): with 253 layers of width 768, Adam's first, sign-like
steps move every one of 1.8B parameters by the learning rate, and at 1e-5 or 3e-5 the third step's
loss rose again (measured).

Example:
    $ python bench/capacity.py --memory-limit 2GiB --state-bytes 20GiB --dir runs/capacity
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import jax

from zinfjax.benchmarks.cgroup import MemoryCgroup, train_in_cgroup
from zinfjax.benchmarks.io import parse_size
from zinfjax.models import ModelConfig

ADAM_BYTES_PER_PARAM = 12  # fp32 parameter + Adam m + Adam v


def param_count(config: ModelConfig) -> int:
    """Parameters of a model of this size (from abstract shapes: nothing allocated).

    Example:
        >>> param_count(ModelConfig.named("gpt2-mini"))
        4870144
    """
    from zinfjax import models
    from zinfjax.models.stacked import lm_init

    abstract = jax.eval_shape(lm_init(models.build(config)), jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def sized_model(state_bytes: int, d_model: int, vocab_size: int = 256, seq_len: int = 64) -> ModelConfig:
    """The GPT-2 of width ``d_model`` with the fewest layers whose Adam state reaches ``state_bytes``.

    Example:
        >>> sized_model(20 << 30, 768).n_layers
        253
    """
    base = ModelConfig.named("gpt2-mini").replace(
        d_model=d_model, n_heads=d_model // 64, d_ff=4 * d_model, vocab_size=vocab_size, max_seq_len=seq_len,
        n_layers=1)
    one, two = param_count(base), param_count(base.replace(n_layers=2))
    block, outer = two - one, 2 * one - two  # one block's parameters; embed + head
    return base.replace(n_layers=max(1, math.ceil((state_bytes / ADAM_BYTES_PER_PARAM - outer) / block)))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-limit", type=parse_size, default="2GiB", help="memory cgroup limit of the training")
    p.add_argument("--state-bytes", type=parse_size, default="20GiB", help="training state to reach (12 B/param)")
    p.add_argument("--dir", default="runs/capacity", help="directory on the NVMe filesystem for the state")
    p.add_argument("--d-model", type=int, default=768, help="model width; the layer count follows")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate (see the module docstring)")
    p.add_argument("--keep", action="store_true", help="keep the state directory afterwards")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: `zinfjax bench capacity --memory-limit 2GiB --state-bytes 20GiB`; prints one JSON object."""
    args = parser().parse_args(argv)
    if not MemoryCgroup.available():
        raise SystemExit("zinfjax bench capacity needs a writable cgroup v1 memory controller at "
                         "/sys/fs/cgroup/memory (run as root on a cgroup v1 host)")
    os.makedirs(args.dir, exist_ok=True)
    model = sized_model(args.state_bytes, args.d_model, seq_len=max(args.seq_len, 64))
    model_file = os.path.join(args.dir, "model.json")
    with open(model_file, "w") as f:
        json.dump(model.__dict__, f)
    state = os.path.join(args.dir, "state")
    sets = [f"model={model_file}", f"steps={args.steps}", f"batch_size={args.batch_size}", f"seq_len={args.seq_len}",
            f"lr={args.lr}", "params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme",
            f"nvme_path={state}", f"memory_limit={args.memory_limit}"]
    try:
        result = train_in_cgroup(sets, args.memory_limit, args.dir)
    finally:
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)
    n = param_count(model)
    print(json.dumps({"state_GB": n * ADAM_BYTES_PER_PARAM / 1e9, "state_GiB": n * ADAM_BYTES_PER_PARAM / 2**30,
                      "params": n, "model": {"arch": model.arch, "d_model": model.d_model, "n_layers": model.n_layers,
                                             "vocab_size": model.vocab_size},
                      **result, "state_kept": args.keep}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
