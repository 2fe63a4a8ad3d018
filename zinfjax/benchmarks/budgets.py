"""Budget benchmark: one model trained through ``zinfjax train`` at several memory budgets, only ``memory_limit``
varying, each in a memory cgroup of that size (docs/BENCHMARKS.md's table).

Every run gives ``nvme_path`` and no tier key, so ``tiers=auto`` (the default then) places the state: host
memory first, a part split by layer with NVMe where it does not fit (docs/planning.md, "Memory first"). Each
point reports the placement chosen and its predicted step, the measured step (the median of the steps after
the first), the step's floor (max(compute alone, its NVMe bytes at the disk's probed rates): ``io_floor_s``
and ``floor_compute`` of the log), the step over it, and the I/O path's CPU seconds per GB moved. One more run
places every part in host memory by hand (``--all-host``), the step a budget that holds the whole state is
held to.

Runs:

- ``gpt2-large``: fp32, batch 1 x 256;
- ``llama-1b``: bf16, batch 1 x 256.

Example:
    $ python bench/budgets.py --model gpt2-large --budgets 3GiB,5GiB,7GiB,9GiB,11GiB,14GiB --dir runs/budgets
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

from zinfjax.benchmarks.cgroup import train_in_cgroup
from zinfjax.benchmarks.io import parse_size
from zinfjax.store.threads import io_cpu_seconds

MODELS = {
    "gpt2-large": ["model=gpt2-large", "batch_size=1", "seq_len=256"],
    "llama-1b": ["model=llama-1b", "batch_size=1", "seq_len=256", "precision=bf16"],
}
HOST = ["params=host", "optimizer=host", "gradients=host", "activations=host"]


def point(model: str, budget: str, args, tiers: list[str] | None = None) -> dict:
    """One ``zinfjax train`` run of ``model`` at ``memory_limit=budget`` in a cgroup of that size."""
    limit = parse_size(budget)
    work = os.path.join(args.dir, model, budget if tiers is None else f"{budget}-host")
    nvme = os.path.join(work, "nvme")
    sets = [*MODELS[model], f"steps={args.steps}", f"memory_limit={budget}", f"nvme_path={nvme}", *(tiers or [])]
    try:
        run = train_in_cgroup(sets, limit, work)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    out = {"model": model, "memory_limit": budget, **{k: run[k] for k in ("cgroup_max_usage_GB", "oom_kills")}}
    if "error" in run:
        return {**out, "error": run["error"]}
    with open(run["log"]) as f:
        log = json.load(f)
    later = log["steps"][1:] or log["steps"]
    step = statistics.median(s["step_s"] for s in later)
    last = later[-1]
    moved = last.get("read_bytes_nvme", 0) + last.get("write_bytes_nvme", 0)
    compute = (log.get("floor_compute") or {}).get("compute_alone_s")
    io_floor = last.get("io_floor_s", 0.0)
    floor = max(compute or 0.0, io_floor)
    io_cpu = statistics.median(io_cpu_seconds(s) for s in later)
    chosen = {k: log["config"][k] for k in ("params", "optimizer", "gradients", "activations")}
    predicted = (log.get("placement") or {}).get("predicted_step_s")
    return {**out, "tiers": chosen, "step_s": step, "steps_s": [s["step_s"] for s in log["steps"]],
            "predicted_step_s": predicted, "planned_regime": (log.get("placement") or {}).get("regime"),
            "predicted_over_measured": predicted / step if predicted else None,
            "compute_alone_s": compute, "io_floor_s": io_floor, "floor_s": floor,
            "step_over_floor": step / floor if floor else None,
            "nvme_GB_per_step": moved / 1e9, "io_cpu_s_per_GB": io_cpu / (moved / 1e9) if moved else None,
            "prefetch_depth": (log.get("budget") or {}).get("prefetch_depth"),  # the in-memory loop has no budget
            "lean": (log.get("budget") or {}).get("lean"), "keeps_heap": (log.get("budget") or {}).get("keeps_heap"),
            "recompute": log.get("recompute"), "update_parts": log.get("update_parts"),
            "planned_engine": (log.get("placement") or {}).get("engine"),
            "cpu_s": {k[len("cpu_s_"):]: statistics.median(s.get(k, 0.0) for s in later)
                      for k in sorted(last) if k.startswith("cpu_s_")},
            "trainer": "engine" if log.get("budget") else "in-memory",
            "peak_rss_GB": run["peak_rss_GB"], "init_s": run["init_s"], "losses": run["losses"]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench budgets", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--budgets", required=True, help="comma-separated memory_limit values, e.g. 3GiB,6GiB,9GiB")
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is left out of the median")
    p.add_argument("--all-host", default=None, help="also run every part in host memory at this budget")
    p.add_argument("--dir", default="runs/budgets", help="directory on the NVMe filesystem for the states and logs")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: ``zinfjax bench budgets --model M --budgets A,B,...``; prints one JSON object per run."""
    args = parser().parse_args(argv)
    for budget in args.budgets.split(","):
        print(json.dumps(point(args.model, budget, args)), flush=True)
    if args.all_host:
        print(json.dumps(point(args.model, args.all_host, args, HOST)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
