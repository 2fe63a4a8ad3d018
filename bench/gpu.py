"""GPU benchmark: llama-1b in bf16 through `zinfjax train`, optimizer offloaded, against everything on the device.

Three placements, each a fresh ``zinfjax train`` process (the user's path) with a JSON log:

- ``host``: parameters and optimizer state on the host, gradients and activations on the device;
- ``nvme_optimizer``: parameters on the host, optimizer state on NVMe;
- ``device``: everything on the device (the reference; it may not fit, and then says so).

The optimizer update runs where ``--update-on`` says (default ``auto``: on the host CPU for the two
offloaded placements on a GPU, so only gradients go down and compute copies come up).

For each: the median step over the steps after the first two, tokens/s, MFU (6 x parameters x
tokens per step over the step time and the device's peak bf16 FLOP/s), the device's peak memory
(``memory_stats``), the bytes over the host link per step (``host_link_bytes``) and the NVMe I/O
floor at the disk's measured speed. Prints one JSON object.

It asks for a GPU (``--platform gpu``); on a machine without one it stops with a one-line error
that names the platforms found. ``--platform cpu --model gpt2-tiny`` runs the same path on the CPU,
as the tests do.

Example:
    $ .venv/bin/python bench/gpu.py --dir /mnt/nvme/zinfjax-gpu
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEMENTS = {
    "host": dict(params="host", optimizer="host", gradients="device", activations="device"),
    "nvme_optimizer": dict(params="host", optimizer="nvme", gradients="device", activations="device"),
    "device": dict(params="device", optimizer="device", gradients="device", activations="device"),
}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}
SKIP = 2  # steps left out of the median: compilation and the first read of every layer


class NoDevice(SystemExit):
    """The platform asked for is not on this machine."""


def check_platform(platform: str) -> list:
    """The devices of ``platform``; a one-line exit naming the platforms found when there are none."""
    import jax

    try:
        return jax.devices(platform)
    except RuntimeError:
        found = sorted({d.platform for d in jax.devices()})
        raise NoDevice(f"bench/gpu.py: no {platform} device on this machine (platforms found: {', '.join(found)}); "
                       "run it where one is, or pass --platform cpu for a dry run") from None


def peak_flops(device, override: float | None) -> float | None:
    """The device's dense bf16 peak in FLOP/s, from ``--peak-tflops`` or the device kind."""
    if override:
        return override * 1e12
    kind = getattr(device, "device_kind", "")
    for name, tflops in PEAK_BF16_TFLOPS.items():
        if name in kind:
            return tflops * 1e12
    return None


def param_count(model: str) -> int:
    from zinfjax.checkpoint.model import resolve_model
    from zinfjax.planning.scale import parameter_count

    return parameter_count(resolve_model(model))


def train(args, name: str, tiers: dict) -> dict:
    """One ``zinfjax train`` run; its log's figures, or ``{"error": ...}`` when it fails (e.g. does not fit)."""
    log = os.path.join(args.dir, f"{name}.json")
    sets = {"model": args.model, "precision": "bf16", "batch_size": args.batch_size, "seq_len": args.seq_len,
            "grad_accum": args.grad_accum, "steps": args.steps, "nvme_path": os.path.join(args.dir, "nvme", name),
            "log": log, "mesh": "data:1", **tiers,
            "update_on": args.update_on if tiers["optimizer"] != "device" else "auto"}  # the state is where it runs
    env = one_device_env()  # one CPU device, as a user's process
    env["JAX_PLATFORMS"] = args.platform
    cmd = [sys.executable, "-m", "zinfjax.cli", "train", "--quiet", *[a for k, v in sets.items()
                                                                      for a in ("--set", f"{k}={v}")]]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    shutil.rmtree(os.path.join(args.dir, "nvme", name), ignore_errors=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    with open(log) as f:
        record = json.load(f)
    logged = record["steps"]
    steps = logged[SKIP:] or logged[-1:]
    median = lambda key: statistics.median(s.get(key, 0) for s in steps)  # noqa: E731
    tokens_per_s = median("tokens_per_s")  # every trainer logs it (the in-memory one has no step_s)
    return {"step_s": args.batch_size * args.seq_len / tokens_per_s, "tokens_per_s": tokens_per_s,
            "device_peak_GB": max(s.get("device_peak_bytes", 0) for s in steps) / 1e9 or None,
            "host_link_bytes": median("host_link_bytes"),
            "host_tier_bytes": median("read_bytes_host") + median("write_bytes_host"),
            "nvme_bytes": median("read_bytes_nvme") + median("write_bytes_nvme"),
            "read_bytes_nvme": median("read_bytes_nvme"), "write_bytes_nvme": median("write_bytes_nvme"),
            "stall_s": median("stall_s"), "peak_rss_GB": max(s["peak_rss_bytes"] for s in steps) / 1e9,
            "losses": [round(s["loss"], 4) for s in steps], "update_on": record.get("update_on", "device"),
            "host_memory_kind": record.get("host_memory_kind"), "command": " ".join(cmd[2:])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", default="gpu", help="gpu (default), tpu, or cpu for a dry run")
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (with --grad-accum micro-batches)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step: compute that hides the update")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, when its kind is not known")
    p.add_argument("--dir", default="runs/gpu", help="a directory on the NVMe disk")
    p.add_argument("--only", choices=sorted(PLACEMENTS), action="append")
    p.add_argument("--update-on", default="auto", choices=["auto", "device", "host"],
                   help="where the optimizer update runs (auto: on the host CPU when the state is off the GPU)")
    args = p.parse_args(argv)
    try:
        devices = check_platform(args.platform)
    except NoDevice as e:
        print(e.code, file=sys.stderr)
        return 2
    from zinfjax.store.probe import raw_direct_io

    os.makedirs(args.dir, exist_ok=True)
    disk = raw_direct_io(os.path.join(args.dir, "probe.bin"), 256 << 20)
    n, peak = param_count(args.model), peak_flops(devices[0], args.peak_tflops)
    runs = {}
    for name in args.only or PLACEMENTS:
        run = runs[name] = train(args, name, PLACEMENTS[name])
        if "error" in run:
            continue
        flops = 6 * n * args.batch_size * args.seq_len
        run["mfu"] = flops / run["step_s"] / peak if peak else None
        run["io_floor_s"] = (run["read_bytes_nvme"] / (disk["raw_read_GBps"] * 1e9)
                             + run["write_bytes_nvme"] / (disk["raw_write_GBps"] * 1e9))
        run["host_link_bytes_per_param"] = run["host_link_bytes"] / n
    device_step = runs.get("device", {}).get("step_s")
    for run in runs.values():
        if device_step and "step_s" in run:
            run["over_device_step"] = run["step_s"] / device_step
    print(json.dumps({"device": getattr(devices[0], "device_kind", str(devices[0])), "platform": args.platform,
                      "model": args.model, "parameters": n, "precision": "bf16", "batch_size": args.batch_size,
                      "seq_len": args.seq_len, "grad_accum": args.grad_accum, "peak_bf16_flops": peak,
                      "disk": disk, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
