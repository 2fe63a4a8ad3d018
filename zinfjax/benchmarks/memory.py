"""Memory benchmark: models larger than memory, trained through ``zinfjax train`` inside memory cgroups.

Each run is a fresh ``zinfjax train`` process (the user's path, its defaults: the memory budget,
layer-by-layer initialisation, vocabulary chunks) with every tier on NVMe, inside a cgroup v1
memory group whose limit counts page cache too; the page cache is dropped before each run. The
runs (docs/BENCHMARKS.md's table):

- ``gpt2-small``: batch 4 x 128, 5 steps, ``memory_limit=1GiB``, in a 1 GiB cgroup;
- ``gpt2-large`` from scratch: batch 1 x 64, 3 steps, in a 2 GiB cgroup;
- ``llama-1b`` from scratch: batch 1 x 64, 3 steps, bf16, in a 2 GiB cgroup.

The state is ZeRO's model states: 16 bytes per parameter in fp32 (params, grads, Adam m and v),
18 in bf16 (bf16 params, fp32 grads, fp32 master, m and v). Initialisation is compared with the
time to write the state the engine writes at initialisation at the disk's measured direct-I/O speed.

Example:
    $ python bench/memory.py --dir /work/main/runs/memory
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

from zinfjax.benchmarks.cgroup import MemoryCgroup, train_in_cgroup
from zinfjax.benchmarks.io import parse_size, raw_direct_io
from zinfjax.models.configs import ModelConfig
from zinfjax.planning.scale import parameter_count

RUNS = {
    "gpt2-small": dict(sets=["model=gpt2-small", "batch_size=4", "seq_len=128", "steps=5", "memory_limit=1GiB"],
                       limit="1GiB"),
    "gpt2-large": dict(sets=["model=gpt2-large", "batch_size=1", "seq_len=64", "steps=3"], limit="2GiB"),
    "llama-1b": dict(sets=["model=llama-1b", "batch_size=1", "seq_len=64", "steps=3", "precision=bf16"],
                     limit="2GiB"),
}
NVME = ["params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme"]
STATE_BYTES = {"fp32": 16, "bf16": 18}  # ZeRO's model states per parameter
INIT_BYTES = {"fp32": 12, "bf16": 14}  # what initialisation writes: params (+ master), Adam m and v


def run_one(name: str, spec: dict, args) -> dict:
    limit = parse_size(spec["limit"])
    state_dir = os.path.join(args.dir, name, "nvme")
    sets = [*spec["sets"], *NVME, f"nvme_path={state_dir}"]
    try:
        result = train_in_cgroup(sets, limit, os.path.join(args.dir, name))
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    precision = "bf16" if "precision=bf16" in spec["sets"] else "fp32"
    n = parameter_count(ModelConfig.named(name))
    result.update({"params": n, "precision": precision, "state_GB": n * STATE_BYTES[precision] / 1e9,
                   "init_write_GB": n * INIT_BYTES[precision] / 1e9, "config": sets})
    if "peak_rss_GB" in result:
        result["peak_rss_over_state"] = result["peak_rss_GB"] / result["state_GB"]
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/memory", help="directory on the NVMe filesystem for the states and logs")
    p.add_argument("--only", choices=sorted(RUNS), action="append", help="run only these (repeatable)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: ``zinfjax bench memory --dir DIR``; prints one JSON object."""
    args = parser().parse_args(argv)
    if not MemoryCgroup.available():
        raise SystemExit("zinfjax bench memory needs a writable cgroup v1 memory controller at "
                         "/sys/fs/cgroup/memory (run as root on a cgroup v1 host)")
    os.makedirs(args.dir, exist_ok=True)
    raw = raw_direct_io(os.path.join(args.dir, "raw"), 1 << 30)  # {"raw_write_GBps", "raw_read_GBps"}
    runs = {name: run_one(name, RUNS[name], args) for name in args.only or RUNS}
    for r in runs.values():
        if "init_s" in r:
            r["init_over_write_floor"] = r["init_s"] / (r["init_write_GB"] / raw["raw_write_GBps"])
    small = runs.get("gpt2-small", {})
    out = {
        "runs": runs,
        "raw_read_GBps": raw["raw_read_GBps"],
        "raw_write_GBps": raw["raw_write_GBps"],
        "targets": {
            "all_complete_finite_no_oom": all(r.get("steps_completed", 0) == int(_steps(r)) and not r["oom_kills"]
                                              and all(math.isfinite(x) for x in r["losses"]) for r in runs.values()),
            "gpt2_small_peak_rss_over_state": small.get("peak_rss_over_state"),
            "gpt2_large_init_over_write_floor": runs.get("gpt2-large", {}).get("init_over_write_floor"),
        },
    }
    print(json.dumps(out))
    return 0


def _steps(run: dict) -> int:
    return next(int(s.split("=")[1]) for s in run["config"] if s.startswith("steps="))


if __name__ == "__main__":
    sys.exit(main())
