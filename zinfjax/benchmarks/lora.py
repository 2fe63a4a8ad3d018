"""LoRA benchmark: llama-7b's adapters trained through ``zinfjax train`` in a 3 GiB memory cgroup, against its floor.

Two fresh ``zinfjax train`` processes of the same run: LoRA rank 16 on q and v of ``llama-7b`` in bf16, batch
1 x 64, 3 steps, the base initialised layer by layer (bitwise as ``model.init``):

- ``nvme``: every tier on NVMe, inside a 3 GiB cgroup v1 memory group (page cache counted), the page cache
  dropped first: the base (13.5 GB of bf16) goes straight to ``nvme_path``, and each step reads it;
- ``memory``: every tier in host memory (a 22 GiB cgroup): the same program with no byte from the disk, whose
  step is the compute alone.

The floor of the NVMe step is max(the memory run's step, the bytes the NVMe step reads at the disk's
measured O_DIRECT read rate), and the target is at most 1.15 x that floor. The step log's writes are the
adapters' alone (their bf16 copy, fp32 master, Adam m and v: 14 bytes a parameter).

Example:
    $ python bench/lora.py --dir /work/main/runs/lora
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

from zinfjax.benchmarks.cgroup import MemoryCgroup, train_in_cgroup
from zinfjax.benchmarks.io import parse_size, raw_direct_io

RUN = ["model=llama-7b", "lora_rank=16", "lora_targets=q,v", "precision=bf16", "batch_size=1", "seq_len=64",
       "steps=3"]
NVME = ["params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme"]
MEMORY = ["params=host", "optimizer=host", "gradients=host", "activations=host"]
TARGET = 1.15


def adapter_params(run: list[str]) -> int:
    """The LoRA parameters of the run (from abstract shapes: nothing allocated)."""
    import math

    import jax

    from zinfjax import Config
    from zinfjax.models import build
    from zinfjax.models.lora import is_adapter
    from zinfjax.models.stacked import lm_init
    from zinfjax.trainers.build import run_model

    config = Config.load(None, run)
    abstract = jax.eval_shape(lm_init(build(run_model(config)[1])), jax.random.key(0))
    return sum(math.prod(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0] if is_adapter(p))


def one(name: str, sets: list[str], limit: int | None, args) -> dict:
    state = os.path.join(args.dir, name, "nvme")
    try:
        return train_in_cgroup([*sets, f"nvme_path={state}"], limit, os.path.join(args.dir, name))
    finally:
        shutil.rmtree(state, ignore_errors=True)


def summary(nvme: dict, memory: dict, raw: dict, adapters: int) -> dict:
    """The floor, the ratio and the bytes per step, from the two runs' figures (the median step after the first)."""
    with open(nvme["log"]) as f:
        last = json.load(f)["steps"][-1]
    step = statistics.median(nvme["step_s"][1:])
    compute = statistics.median(memory["step_s"][1:])
    read = last.get("read_bytes_nvme", 0)
    floor = max(compute, read / 1e9 / raw["raw_read_GBps"])
    return {"step_s": step, "compute_step_s": compute, "read_GB_per_step": read / 1e9,
            "write_MB_per_step": last.get("write_bytes_nvme", 0) / 1e6, "adapter_params": adapters,
            "adapter_state_MB": adapters * 14 / 1e6, "floor_s": floor, "step_over_floor": step / floor,
            "target": TARGET, "met": step <= TARGET * floor}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/lora", help="directory on the NVMe filesystem for the state and logs")
    p.add_argument("--limit", default="3GiB", help="the NVMe run's memory cgroup limit")
    p.add_argument("--memory-limit", default="22GiB", help="the in-memory run's cgroup limit (the base is 13.5 GB)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: ``zinfjax bench lora --dir DIR``; prints one JSON object."""
    args = parser().parse_args(argv)
    if not MemoryCgroup.available():
        raise SystemExit("zinfjax bench lora needs a writable cgroup v1 memory controller at /sys/fs/cgroup/memory "
                         "(run as root on a cgroup v1 host)")
    os.makedirs(args.dir, exist_ok=True)
    raw = raw_direct_io(os.path.join(args.dir, "raw"), 1 << 30)
    nvme = one("nvme", [*RUN, *NVME], parse_size(args.limit), args)
    memory = one("memory", [*RUN, *MEMORY], parse_size(args.memory_limit), args)
    out = {"nvme": nvme, "memory": memory, **raw, "run": RUN}
    if "error" not in nvme and "error" not in memory:
        out["summary"] = summary(nvme, memory, raw, adapter_params(RUN))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
