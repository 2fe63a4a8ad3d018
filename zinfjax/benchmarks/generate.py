"""Generation benchmark: tokens/s with parameters in memory, on host and on NVMe, at several batch sizes.

One GPT-2 of about 100M parameters (byte vocabulary, so the blocks hold the parameters, as in
``bench step``), greedy decoding of ``--new-tokens`` tokens after a ``--prompt-len`` prompt. For
each tier (``device``: parameters in memory; ``host``; ``nvme``, read with O_DIRECT so every byte
comes from the disk) and each batch size, it reports tokens/s (sequences x new tokens / time,
prefill included) and the median decoding step. Batch-major decoding reads each layer once per
step for the whole batch, so tokens/s should rise with the batch size until compute dominates.

The I/O floor of one decoding step is the parameter bytes it reads from NVMe over the raw O_DIRECT
read bandwidth of the same directory (`raw_direct_io`), measured before and after.

Example:
    $ python bench/generate.py --dir runs/generate
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

from zinfjax._util.choices import TIERS
from zinfjax.benchmarks.io import parse_size, raw_direct_io

GB = 1e9


def bench_model(args):
    from zinfjax.models import ModelConfig

    return ModelConfig.named("gpt2-mini").replace(d_model=args.d_model, n_layers=args.layers,
                                                  n_heads=args.d_model // 64, d_ff=4 * args.d_model,
                                                  max_seq_len=args.prompt_len + args.new_tokens)


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zinfjax import Config, models
    from zinfjax.inference import Sampling
    from zinfjax.inference.generate import Generator
    from zinfjax.inference.params import ParamStores

    model_config = bench_model(args)
    model = models.build(model_config)
    params = model.init(jax.random.key(0), jnp.zeros((1, args.prompt_len), jnp.int32))["params"]
    params = jax.tree.map(np.asarray, params)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    out = {}
    for tier in args.tiers.split(","):
        config = Config(params=tier, kv_cache="device", nvme_path=os.path.join(args.dir, "state"),
                        prefetch_depth=args.prefetch_depth, host_buffer_bytes=args.host_buffer_bytes)
        stores = ParamStores.from_tree(params, config)
        try:
            for batch in map(int, args.batch_sizes.split(",")):
                prompts = np.random.default_rng(batch).integers(0, model_config.vocab_size, (batch, args.prompt_len))
                gen = Generator(model_config, stores, config, batch, args.prompt_len + args.new_tokens)
                try:
                    gen.run(prompts, 2, Sampling())  # compiles the prefill and the decoding step
                    t0 = time.perf_counter()
                    _, m = gen.run(prompts, args.new_tokens, Sampling())
                    m["wall_s"] = time.perf_counter() - t0
                finally:
                    gen.close()
                out[f"{tier}_b{batch}"] = m
                print(f"{tier} batch {batch}: {m['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
        finally:
            stores.close()
            shutil.rmtree(config.nvme_path, ignore_errors=True)
    return {"params": n_params, "param_bytes": n_params * 4, "runs": out}


def summary(args, result: dict, raw: list[dict]) -> dict:
    read_bw = statistics.mean(r["raw_read_GBps"] for r in raw) * GB
    table = {}
    for key, m in result["runs"].items():
        tier, batch = key.rsplit("_b", 1)
        table.setdefault(tier, {})[batch] = round(m["tokens_per_s"], 2)
    per_step = result["param_bytes"]
    nvme_steps = [m for k, m in result["runs"].items() if k.startswith("nvme")]
    return {
        "tokens_per_s": table,
        "decode_step_s": {k: m["decode_step_s"] for k, m in result["runs"].items()},
        "io_floor_per_decode_step_s": per_step / read_bw,
        "nvme_read_bytes_per_decode_step": per_step,
        "nvme_bytes_read_per_run": {k: m.get("read_bytes_nvme", 0) for k, m in result["runs"].items()
                                    if k.startswith("nvme")},
        "nvme_decode_over_floor": {k: m["decode_step_s"] / (per_step / read_bw) for k, m in result["runs"].items()
                                   if k.startswith("nvme")} if nvme_steps else {},
        "raw_read_GBps": read_bw / GB,
        "model": {"params": result["params"], "d_model": args.d_model, "n_layers": args.layers, "vocab_size": 256},
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "precision": "fp32", "greedy": True,
        "kv_cache": "device", "nvme_isolation": "O_DIRECT chunk reads (no page cache)",
        "runs": result["runs"], "raw_runs": raw,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/generate", help="directory on the NVMe filesystem")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=32, help="GPT-2 blocks (32 x d_model 512: 101M params)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--tiers", default=",".join(TIERS))
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--host-buffer-bytes", type=parse_size, default="256MiB")
    p.add_argument("--raw-bytes", type=parse_size, default="1GiB", help="bytes of each raw O_DIRECT test")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: `zinfjax bench generate [--dir PATH]`; prints one JSON object."""
    args = parser().parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    raw_path = os.path.join(args.dir, "raw.bin")
    raw = [raw_direct_io(raw_path, args.raw_bytes)]
    result = run(args)
    raw.append(raw_direct_io(raw_path, args.raw_bytes))
    print(json.dumps(summary(args, result, raw)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
