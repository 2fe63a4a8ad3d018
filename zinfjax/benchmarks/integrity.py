"""What checking every NVMe chunk's crc32c on its way back costs a step: ``verify_chunks`` on against off.

Runs ``zinfjax train`` (gpt2-small, batch 4 x 128, every part on NVMe, the user's defaults otherwise) in pairs,
the check on and off one after the other, so that drift in the machine's speed falls on both alike. Each run's
step is the median of its steps after the first two; the cost is the median over the pairs of (on / off - 1).
Beside it: the bytes each step reads back (what the check hashes), the checksum's own speed on this CPU, and the
I/O threads' CPU seconds per step with the check on and off.

Example:
    $ zinfjax bench integrity --pairs 3 --precision bf16 --dir runs/integrity
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from zinfjax.store.chunkfile import crc32c
from zinfjax.store.threads import io_cpu_seconds

SETTINGS = ["model=gpt2-small", "batch_size=4", "seq_len=128", "params=nvme", "optimizer=nvme", "gradients=nvme",
            "activations=nvme"]


def run(args, verify: bool, k: int) -> dict:
    """One ``zinfjax train`` run; its median step (after the first two) and its I/O threads' CPU seconds."""
    work = os.path.join(args.dir, f"{'on' if verify else 'off'}-{k}")
    shutil.rmtree(work, ignore_errors=True)
    log = os.path.join(work, "log.json")
    sets = [*SETTINGS, f"precision={args.precision}", f"steps={args.steps}", f"nvme_path={work}/nvme", f"log={log}",
            f"verify_chunks={str(verify).lower()}"]
    argv = [sys.executable, "-m", "zinfjax.cli", "train", "--quiet", *[a for s in sets for a in ("--set", s)]]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    with open(log) as f:
        steps = json.load(f)["steps"][2:]
    shutil.rmtree(work, ignore_errors=True)
    return {"step_s": statistics.median(s["step_s"] for s in steps),
            "io_cpu_s": statistics.median(io_cpu_seconds(s) for s in steps),
            "read_GB": steps[-1].get("read_bytes_nvme", 0) / 1e9}


def checksum_GBps(nbytes: int = 256 << 20, repeats: int = 4) -> float:
    """The crc32c's speed on this CPU over ``nbytes`` of random data (one thread)."""
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    crc32c(data)
    started = time.perf_counter()
    for _ in range(repeats):
        crc32c(data)
    return repeats * nbytes / (time.perf_counter() - started) / 1e9


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench integrity", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="runs with the check on and off, one after the other")
    p.add_argument("--steps", type=int, default=8, help="steps per run; the first two are left out")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--dir", default="runs/integrity", help="directory on the NVMe filesystem for the runs")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: ``zinfjax bench integrity``; prints one JSON object."""
    args = parser().parse_args(argv)
    pairs = [(run(args, True, k), run(args, False, k)) for k in range(args.pairs)]
    costs = [on["step_s"] / off["step_s"] - 1 for on, off in pairs]
    on_s, off_s = (statistics.median(p[i]["step_s"] for p in pairs) for i in (0, 1))
    print(json.dumps({
        "benchmark": "integrity", "settings": [*SETTINGS, f"precision={args.precision}", f"steps={args.steps}"],
        "step_s_verified": on_s, "step_s_unverified": off_s, "pair_costs": costs,
        "cost": statistics.median(costs), "read_GB_per_step": pairs[0][0]["read_GB"],
        "crc32c_GBps": checksum_GBps(),
        "io_cpu_s_verified": statistics.median(p[0]["io_cpu_s"] for p in pairs),
        "io_cpu_s_unverified": statistics.median(p[1]["io_cpu_s"] for p in pairs),
        "runs": [{"verified": on, "unverified": off} for on, off in pairs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
