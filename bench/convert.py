"""`zinfjax convert` of a checkpoint larger than its memory cgroup; prints one JSON object.

A GPT-2-shaped Hugging Face checkpoint of ``--model-bytes`` (fp32, random values) is written one
tensor at a time; then ``zinfjax convert`` turns it into a zinfjax checkpoint (weights and a fresh
adamw state: three times the source) and back into safetensors (``--to hf``), each in a fresh
process inside a memory cgroup v1 of ``--memory-limit`` (page cache included; the cache is
dropped before each, so every byte read is charged inside the group). The exported
file is compared with the source tensor by tensor; it must be bit for bit the same.

Example:
    $ python bench/convert.py --dir runs/convert --model-bytes 3GiB --memory-limit 512MiB
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

import numpy as np

from zinfjax._util.byte_sizes import parse_bytes
from zinfjax.benchmarks.cgroup import MemoryCgroup

GB = 1e9
VOCAB, CONTEXT, HEAD_DIM = 50257, 1024, 64


def gpt2_tensors(layers: int, d: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a GPT2LMHeadModel checkpoint of width ``d`` (tied lm_head left out), in HF's names."""
    out = [("transformer.wte.weight", (VOCAB, d)), ("transformer.wpe.weight", (CONTEXT, d))]
    for i in range(layers):
        h = f"transformer.h.{i}."
        out += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)), (h + "attn.c_attn.weight", (d, 3 * d)),
                (h + "attn.c_attn.bias", (3 * d,)), (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)), (h + "mlp.c_fc.weight", (d, 4 * d)),
                (h + "mlp.c_fc.bias", (4 * d,)), (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,))]
    return out + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def layers_for(nbytes: int, d: int) -> int:
    fixed = sum(math.prod(s) for _, s in gpt2_tensors(0, d)) * 4
    per_layer = sum(math.prod(s) for _, s in gpt2_tensors(1, d)) * 4 - fixed
    return max(1, round((nbytes - fixed) / per_layer))


def write_source(directory: str, layers: int, d: int) -> int:
    """The HF directory: config.json and one model.safetensors, written one tensor at a time."""
    from zinfjax_interop.files import SafetensorsWriter

    os.makedirs(directory, exist_ok=True)
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": VOCAB, "n_positions": CONTEXT,
              "n_embd": d, "n_layer": layers, "n_head": d // HEAD_DIM, "layer_norm_epsilon": 1e-5, "dtype": "float32"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    specs = [(name, np.float32, shape) for name, shape in gpt2_tensors(layers, d)]
    rng = np.random.default_rng(0)
    with SafetensorsWriter(os.path.join(directory, "model.safetensors"), specs) as writer:
        for _, _, shape in specs:
            writer.write(rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))
    return writer.bytes_written


def run_in_cgroup(limit: int, argv: list[str]) -> dict:
    """``zinfjax`` with ``argv`` in a fresh process inside a memory cgroup: its summary, time and memory."""
    drop_page_cache()
    with MemoryCgroup(limit) as cg:
        start = time.perf_counter()
        out = subprocess.run(cg.command([sys.executable, "-m", "zinfjax.cli", *argv]), capture_output=True, text=True)
        seconds = time.perf_counter() - start
        usage, ooms = cg.max_usage_bytes(), cg.oom_kills()
    if out.returncode != 0:
        raise SystemExit(f"zinfjax {' '.join(argv)} failed (exit {out.returncode}, cgroup OOM kills {ooms}):\n"
                         f"{out.stderr[-2000:]}")
    return {"summary": json.loads(out.stdout.strip().splitlines()[-1]), "seconds": seconds,
            "cgroup_max_usage_GB": usage / GB, "cgroup_oom_kills": ooms}


def drop_page_cache() -> None:
    """Writes back and drops the page cache, so the source's pages are read, and charged, inside the cgroup.

    Pages cached by an earlier process stay charged to its group; mapped by the child they would
    count in its RSS but not against its limit.
    """
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def figures(run: dict) -> dict:
    """One conversion's figures: time, cgroup memory, bytes written and their rate."""
    written = run["summary"]["bytes"]
    rate = written / GB / run["seconds"]
    return {k: v for k, v in run.items() if k != "summary"} | {
        "tensors": run["summary"]["tensors"], "written_GB": written / GB, "GB_per_s_written": rate}


def same_tensors(a: str, b: str) -> tuple[int, list[str]]:
    """Compares two safetensors files one tensor at a time: (tensors compared, names that differ)."""
    import safetensors

    with safetensors.safe_open(a, "numpy") as fa, safetensors.safe_open(b, "numpy") as fb:
        names = sorted(fa.keys())
        if sorted(fb.keys()) != names:
            return len(names), sorted(set(fa.keys()) ^ set(fb.keys()))
        differ = [n for n in names if not np.array_equal(fa.get_tensor(n).view(np.uint32),
                                                         fb.get_tensor(n).view(np.uint32))]
    return len(names), differ


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="runs/convert", help="working directory, emptied first (default runs/convert)")
    p.add_argument("--model-bytes", type=parse_bytes, default="3GiB", help="size of the fp32 source checkpoint")
    p.add_argument("--memory-limit", type=parse_bytes, default="1GiB", help="memory cgroup limit of each conversion")
    p.add_argument("--d-model", type=int, default=1024, help="width (default 1024: the embedding is the largest "
                   "tensor, 50257 x d fp32)")
    p.add_argument("--keep", action="store_true", help="keep the files (default: remove them at the end)")
    args = p.parse_args(argv)
    if not MemoryCgroup.available():
        raise SystemExit("bench/convert.py needs a writable cgroup v1 memory controller at /sys/fs/cgroup/memory")
    shutil.rmtree(args.dir, ignore_errors=True)
    src, ckpt, back = (os.path.join(args.dir, n) for n in ("hf-source", "zinfjax", "hf-back"))
    layers = layers_for(args.model_bytes, args.d_model)
    start = time.perf_counter()
    source_bytes = write_source(src, layers, args.d_model)
    write_s = time.perf_counter() - start
    to_zinfjax = run_in_cgroup(args.memory_limit, ["convert", src, ckpt, "--quiet", "--json"])
    to_hf = run_in_cgroup(args.memory_limit, ["convert", ckpt, back, "--to", "hf", "--quiet", "--json"])
    compared, differ = same_tensors(os.path.join(src, "model.safetensors"), os.path.join(back, "model.safetensors"))
    result = {
        "layers": layers, "d_model": args.d_model, "source_GB": source_bytes / GB,
        "memory_limit_GB": args.memory_limit / GB, "source_over_limit": source_bytes / args.memory_limit,
        "source_write_s": write_s, "to_zinfjax": figures(to_zinfjax), "to_hf": figures(to_hf),
        "round_trip_tensors": compared, "round_trip_bitwise": not differ, "differing": differ[:5],
    }
    print(json.dumps(result))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
