"""Capacity benchmark: train a model whose state is many times the memory the process may use.

It builds a GPT-2-style model whose training state (fp32 parameters plus Adam's m and v: 12
bytes per parameter) is at least ``--state-bytes``, initialises it one layer at a time through
a `ParamSource` (the whole model never exists in memory), and runs a few training steps with
parameters, optimizer state and activations on the nvme tier. The steps run in a child process
inside a memory cgroup (v1) limited to ``--memory-limit``: page cache counts against the limit
too, so the state streams from the disk.

Every step trains on the same batch, with AdamW at a small learning rate (1e-6): with 253
layers of width 768, Adam's first, sign-like steps move every one of 1.8B parameters by the
learning rate, and at 1e-5 or 3e-5 the third step's loss already rose again (measured).

Example:
    $ python bench/capacity.py --memory-limit 2GiB --state-bytes 20GiB --dir runs/capacity
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from zinfjax.allocator import tune_allocator
from zinfjax.benchmarks.io import parse_size
from zinfjax.benchmarks.process import peak_rss_bytes
from zinfjax.models import ModelConfig

ADAM_BYTES_PER_PARAM = 12  # fp32 parameter + Adam m + Adam v


# ---- a model built one layer at a time ---------------------------------------------------------


def layerwise_source(config: ModelConfig, seed: int = 0):
    """A `ParamSource` that initialises one layer of a GPT-2 model at a time.

    Each layer gets its own key (``fold_in(seed, index)``), so the values do not match
    ``GPT.init``; they have the same shapes and the same initialisers.

    Example:
        >>> source = layerwise_source(ModelConfig.named("gpt2-mini"))
        >>> source.layer("blocks", 3)["fc"]["kernel"].shape
        (256, 1024)
    """
    from zinfjax.engine.engine import ParamSource
    from zinfjax.models.gpt import Block, Embed, Head

    if config.arch != "gpt2":
        raise ValueError(f"layerwise_source builds gpt2 models; got arch {config.arch!r}")
    t = min(config.max_seq_len, 8)
    tokens = jnp.zeros((1, t), jnp.int32)
    h = jnp.zeros((1, t, config.d_model), jnp.float32)
    wte = jnp.zeros((config.vocab_size, config.d_model), jnp.float32)
    inits = {
        "embed": jax.jit(lambda k: Embed(config).init(k, tokens)["params"]),
        "blocks": jax.jit(lambda k: Block(config).init(k, h)["params"]),
        "head": jax.jit(lambda k: Head(config).init(k, h, {"wte": {"embedding": wte}})["params"]),
    }
    root = jax.random.key(seed)
    index = {"embed": lambda i: 0, "head": lambda i: 1, "blocks": lambda i: 2 + i}

    def layer(group, i):
        return inits[group](jax.random.fold_in(root, index[group](i)))

    abstract = {g: jax.eval_shape(f, root) for g, f in inits.items()}
    abstract["blocks"] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((config.n_layers, *x.shape), x.dtype), abstract["blocks"])
    return ParamSource(abstract, layer)


def param_count(config: ModelConfig) -> int:
    """Parameters of a GPT-2 model of this size (from the abstract layer shapes, nothing allocated).

    Example:
        >>> param_count(ModelConfig.named("gpt2-mini"))
        4870656
    """
    abstract = layerwise_source(config).abstract
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


# ---- process isolation -------------------------------------------------------------------------


CGROUP_ROOT = "/sys/fs/cgroup/memory"


class MemoryCgroup:
    """A cgroup v1 memory group limited to ``limit`` bytes (page cache included); removed on exit.

    Example:
        >>> with MemoryCgroup(2 << 30) as cg:
        ...     subprocess.run(cg.command([sys.executable, "child.py"]))
        ...     cg.max_usage_bytes()
    """

    def __init__(self, limit: int, name: str | None = None):
        self.limit = limit
        self.path = os.path.join(CGROUP_ROOT, name or f"zinfjax_bench_{os.getpid()}_{time.monotonic_ns()}")

    @staticmethod
    def available() -> bool:
        return os.access(CGROUP_ROOT, os.W_OK)

    def __enter__(self) -> MemoryCgroup:
        os.mkdir(self.path)
        self._set("memory.limit_in_bytes", self.limit)
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # the group can be removed only once its last task is reaped
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped so that it runs inside the group from its first instruction."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.path, *argv]

    def max_usage_bytes(self) -> int:
        return int(self._get("memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        fields = dict(line.split() for line in self._get("memory.oom_control").splitlines())
        return int(fields.get("oom_kill", 0))

    def _set(self, key: str, value) -> None:
        with open(os.path.join(self.path, key), "w") as f:
            f.write(str(value))

    def _get(self, key: str) -> str:
        with open(os.path.join(self.path, key)) as f:
            return f.read()


def disk_read_bytes() -> int:
    """Bytes this process has had fetched from storage (page-cache hits excluded), from /proc/self/io."""
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"])


# ---- the benchmark -----------------------------------------------------------------------------


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


def train(args) -> dict:
    """The child: builds the state on NVMe layer by layer and trains ``args.steps`` steps on one batch."""
    import numpy as np

    from zinfjax import Config
    from zinfjax.data import Batches, load_tokens
    from zinfjax.engine import Engine
    from zinfjax.models import build
    from zinfjax.optim import make_optimizer
    from zinfjax.sharding import make_mesh

    tune_allocator()
    model = sized_model(args.state_bytes, args.d_model, seq_len=max(args.seq_len, 64))
    c = Config(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme",
               nvme_path=os.path.join(args.dir, "state"), batch_size=args.batch_size, seq_len=args.seq_len,
               mesh="data:1", prefetch_depth=args.prefetch_depth, host_buffer_bytes=args.host_buffer_bytes,
               lr=args.lr)
    batch = next(Batches(load_tokens("demo"), c.batch_size, c.seq_len, c.seed))
    t0 = time.perf_counter()
    engine = Engine(build(model).layers(), layerwise_source(model, c.seed), make_optimizer(c), c,
                    make_mesh(c.mesh_axes()), (c.batch_size, c.seq_len + 1))
    init_s, metrics = time.perf_counter() - t0, []
    try:
        for _ in range(args.steps):
            metrics.append(engine.train_step(batch))
            print(json.dumps({"step": len(metrics), "loss": metrics[-1]["loss"],
                              "step_s": metrics[-1]["step_s"]}), file=sys.stderr, flush=True)
    finally:
        engine.close()
    losses = [m["loss"] for m in metrics]
    return {
        "steps_completed": len(metrics),
        "losses": losses,
        "losses_finite_and_falling": bool(np.all(np.isfinite(losses)) and all(np.diff(losses) < 0)),
        "same_batch_every_step": True,
        "init_s": init_s,
        "step_s": [m["step_s"] for m in metrics],
        "nvme_read_GB_per_step": [m["read_bytes_nvme"] / 1e9 for m in metrics],
        "nvme_write_GB_per_step": [m["write_bytes_nvme"] / 1e9 for m in metrics],
        "overlap": [m["overlap"] for m in metrics],
        "peak_rss_GB": peak_rss_bytes() / 1e9,
        "params": param_count(model),
        "model": {"arch": model.arch, "d_model": model.d_model, "n_layers": model.n_layers,
                  "vocab_size": model.vocab_size},
        "batch": {"batch_size": c.batch_size, "seq_len": c.seq_len}, "lr": c.lr, "optimizer": c.optimizer_name,
    }


def run_limited(args, argv: list[str]) -> dict:
    """Runs the child inside a memory cgroup limited to ``args.memory_limit``."""
    cmd = [sys.executable, "-m", "zinfjax.benchmarks.capacity", *argv, "--child"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user's process
    with MemoryCgroup(args.memory_limit) as cg:
        out = subprocess.run(cg.command(cmd), env=env, stdout=subprocess.PIPE, text=True)
        usage, ooms = cg.max_usage_bytes(), cg.oom_kills()
    if out.returncode != 0:
        raise RuntimeError(f"the training child failed (exit {out.returncode}, cgroup OOM kills: {ooms})")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "cgroup_max_usage_GB": usage / 1e9,
            "cgroup_oom_kills": ooms}


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
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--host-buffer-bytes", type=parse_size, default="256MiB")
    p.add_argument("--keep", action="store_true", help="keep the state directory afterwards")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: `zinfjax bench capacity --memory-limit 2GiB --state-bytes 20GiB`; prints one JSON object."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(train(args)))
        return 0
    if not MemoryCgroup.available():
        raise SystemExit(f"zinfjax bench capacity needs a writable cgroup v1 memory controller at {CGROUP_ROOT} "
                         "(run as root on a cgroup v1 host)")
    os.makedirs(args.dir, exist_ok=True)
    try:
        result = run_limited(args, argv)
    finally:
        if not args.keep:
            shutil.rmtree(os.path.join(args.dir, "state"), ignore_errors=True)
    model_state = result["params"] * ADAM_BYTES_PER_PARAM
    print(json.dumps({"state_GB": model_state / 1e9, "state_GiB": model_state / 2**30,
                      "memory_limit_GB": args.memory_limit / 1e9, "memory_limit_GiB": args.memory_limit / 2**30,
                      **result, "state_kept": args.keep}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
