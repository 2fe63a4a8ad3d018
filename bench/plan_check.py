"""`zinfjax plan` predicted vs measured step time; prints one JSON object.

For each model (a ~21M-parameter GPT-2, d_model 384 x 12 layers, and the step benchmark's 101M one,
d_model 512 x 32 layers, both with the byte vocabulary, at ``--batch-size`` x ``--seq-len``; and
``gpt2-small`` at the versus-DeepSpeed benchmark's batch of 4 x 128) it runs ``zinfjax plan --json``
(with probes) in a subprocess, then ``zinfjax train`` with every tier on device, on host and on nvme, each in its own
subprocess with a JSON log, and compares the plan's predicted step time with the median of the
measured steps after the first (``batch_size * seq_len / tokens_per_s`` of each logged step), all in
``--precision`` (fp32 by default).

Example:
    $ python bench/plan_check.py --dir runs/plan_check
    $ python bench/plan_check.py --dir runs/plan_check --models gpt2-small --precision bf16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from zinfjax.benchmarks.children import one_device_env

MODELS = {
    "gpt2-21M": {"d_model": 384, "n_layers": 12, "n_heads": 6},
    "gpt2-101M": {"d_model": 512, "n_layers": 32, "n_heads": 8},
    "gpt2-small": None,  # the named model, at its own batch
}
OWN_BATCH = {"gpt2-small": {"batch_size": 4, "seq_len": 128}}
PLACEMENTS = ("device", "host", "nvme")


def model_file(directory: str, name: str, shape: dict) -> str:
    from dataclasses import asdict

    from zinfjax.models import ModelConfig

    m = ModelConfig.named("gpt2-mini").replace(**shape, d_ff=4 * shape["d_model"], max_seq_len=256)
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump(asdict(m), f)
    return path


def zinfjax(*args: str) -> subprocess.CompletedProcess:
    env = one_device_env()  # one CPU device, as a user's process
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"zinfjax {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out


def sets(values: dict) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


def check_model(args, name: str, shape: dict) -> dict:
    nvme = os.path.join(args.dir, "nvme")
    batch = OWN_BATCH.get(name, {"batch_size": args.batch_size, "seq_len": args.seq_len})
    model = name if shape is None else model_file(args.dir, name, shape)
    base = {"model": model, **batch, "mesh": "data:1", "nvme_path": nvme, "precision": args.precision}
    plan = json.loads(zinfjax("plan", "--json", *sets(base)).stdout)
    rows = {}
    for tier in PLACEMENTS:
        tiers = dict.fromkeys(("params", "optimizer", "gradients", "activations"), tier)
        predicted = next(r for r in plan["placements"] if r["tiers"] == tiers)
        log = os.path.join(args.dir, f"{name}-{tier}.json")
        shutil.rmtree(nvme, ignore_errors=True)
        zinfjax("train", "--quiet", *sets({**base, **tiers, "steps": args.steps, "log": log}))
        with open(log) as f:
            steps = json.load(f)["steps"]
        seconds = [batch["batch_size"] * batch["seq_len"] / s["tokens_per_s"] for s in steps[1:]]
        measured = statistics.median(seconds)
        rows[tier] = {"predicted_s": round(predicted["step_s"], 3), "measured_s": round(measured, 3),
                      "ratio": round(predicted["step_s"] / measured, 3), "fits": predicted["fits"],
                      "predicted_parts_s": {k: round(predicted[k], 3) for k in ("compute_s", "host_copy_s",
                                                                                  "nvme_io_s")},
                      "measured_steps_s": [round(s, 3) for s in seconds]}
    shutil.rmtree(nvme, ignore_errors=True)
    return {"parameters": plan["parts"]["parameters"], "batch": batch, "recommended": plan["recommended"],
            "rates": {k: round(v, 4) if isinstance(v, float) else v for k, v in plan["rates"].items()},
            "placements": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/plan_check", help="working directory on the NVMe filesystem")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma separated, of {', '.join(MODELS)}")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="steps per training run; the first is not timed")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = p.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    results = {name: check_model(args, name, MODELS[name]) for name in args.models.split(",")}
    ratios = [r["ratio"] for m in results.values() for r in m["placements"].values()]
    print(json.dumps({"batch": {"batch_size": args.batch_size, "seq_len": args.seq_len}, "steps": args.steps,
                      "precision": args.precision,
                      "statistic": "median of the steps after the first", "models": results,
                      "within_25_percent": sum(0.75 <= r <= 1.25 for r in ratios), "of": len(ratios)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
