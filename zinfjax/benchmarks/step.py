"""Step benchmark: the engine on each tier against the in-memory reference trainer and the I/O floor.

One model (about 100M parameters), one batch, and each configuration in its own process, so
that each peak RSS is its own:

- ``reference``: the plain jitted optax step (zinfjax.trainers.reference), everything in memory;
- ``device`` / ``host``: the engine with every tier on device / host memory;
- ``nvme``: the engine with params, optimizer state, gradients and activations on the nvme
  tier. Its chunk I/O is O_DIRECT, so reads come from the disk and not from the page cache
  (``--isolation cgroup`` also runs it inside a memory cgroup smaller than the state).

Raw disk bandwidth (sequential O_DIRECT, `zinfjax.benchmarks.io.raw_direct_io`) is measured
on the same directory before and after the runs. The I/O floor of the nvme step is the bytes
it moves over that bandwidth; ``overlap_efficiency = max(device_step_s, io_floor_s) /
nvme_step_s`` is 1.0 when the nvme step is as fast as the slower of its compute and its I/O.

Example:
    $ python bench/step.py --dir runs/step
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

from zinfjax.benchmarks.cgroup import MemoryCgroup, disk_read_bytes
from zinfjax.benchmarks.children import one_device_env
from zinfjax.benchmarks.io import parse_size, raw_direct_io
from zinfjax.planning.scale import parameter_count
from zinfjax.runtime import allocator
from zinfjax.runtime.allocator import tune_allocator
from zinfjax.runtime.rss import peak_bytes as peak_rss_bytes

RUNS = ("reference", "device", "host", "nvme")
GB = 1e9


def bench_model(args):
    """The benchmark's GPT-2: byte vocabulary, so the layers (not the embedding) hold the state."""
    from zinfjax.models import ModelConfig

    return ModelConfig.named("gpt2-mini").replace(
        d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // 64, d_ff=4 * args.d_model,
        max_seq_len=max(args.seq_len, 64))


def run_config(args, run: str):
    from zinfjax import Config

    tier = "device" if run == "reference" else run
    return Config(params=tier, optimizer=tier, gradients=tier, activations=tier,
                  nvme_path=os.path.join(args.dir, "state"), batch_size=args.batch_size, seq_len=args.seq_len,
                  mesh="data:1", prefetch_depth=args.prefetch_depth, host_buffer_bytes=args.host_buffer_bytes,
                  lr=1e-3, precision=args.precision)


def one_batch(c):
    """The first batch of the demo corpus; every step trains on it."""
    from zinfjax.data import Batches, load_tokens

    return next(Batches(load_tokens("demo"), c.batch_size, c.seq_len, c.seed))


# ---- one configuration, in a child process -----------------------------------------------------


def time_reference(args, c, batch) -> tuple[list[float], list[float], list[dict]]:
    import jax

    from zinfjax.models import build
    from zinfjax.models.stacked import lm_init, lm_loss
    from zinfjax.sharding import make_mesh
    from zinfjax.trainers.optimizers import make_optimizer
    from zinfjax.trainers.reference import init_state, make_step

    model, tx, mesh = build(bench_model(args)), make_optimizer(c), make_mesh(c.mesh_axes())
    params, opt = init_state(lm_init(model), tx, mesh, c.seed)
    step = make_step(lm_loss(model), tx, mesh, c.grad_accum)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        params, opt, loss = jax.block_until_ready(step(params, opt, batch))
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return times, losses, []


def time_engine(args, c, batch) -> tuple[list[float], list[float], list[dict]]:
    from zinfjax.models import build
    from zinfjax.sharding import make_mesh
    from zinfjax.trainers.streaming import lm_engine

    engine = lm_engine(build(bench_model(args)), c, make_mesh(c.mesh_axes()))
    try:
        metrics = [engine.train_step(batch) for _ in range(args.warmup + args.steps)]
    finally:
        engine.close()
    return [m["step_s"] for m in metrics], [m["loss"] for m in metrics], metrics


def child(args) -> dict:
    """Runs one configuration and returns its figures (the median over the timed steps)."""
    if args.child == "nvme":
        tune_allocator()  # as zinfjax train does when a tier is nvme
    c = run_config(args, args.child)
    batch = one_batch(c)
    disk0 = disk_read_bytes()
    times, losses, metrics = (time_reference if args.child == "reference" else time_engine)(args, c, batch)
    timed = times[args.warmup:]
    out = {"step_s": statistics.median(timed), "step_times_s": [round(t, 3) for t in timed],
           "losses": [round(x, 4) for x in losses], "peak_rss_GB": peak_rss_bytes() / GB,
           "disk_read_GB": (disk_read_bytes() - disk0) / GB}
    if metrics:
        last = metrics[-1]
        keys = ("stall_s", "compute_s", "read_s", "overlap")
        out |= {k: statistics.median(m[k] for m in metrics[args.warmup:]) for k in keys}
        out |= {k: v for k, v in last.items() if k.startswith(("read_bytes_", "write_bytes_"))}
    return out


# ---- the parent: every configuration, the disk, the floor --------------------------------------


def run_child(args, argv: list[str], run: str, cgroup: MemoryCgroup | None) -> dict:
    cmd = [sys.executable, "-m", "zinfjax.benchmarks.step", *argv, "--child", run]
    env = one_device_env()  # one CPU device, as a user's process
    out = subprocess.run(cgroup.command(cmd) if cgroup else cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        oom = cgroup is not None and cgroup.oom_kills() > 0
        raise RuntimeError(f"the {run} run failed (exit {out.returncode}{', killed by the cgroup OOM' if oom else ''})"
                           f":\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_nvme(args, argv: list[str]) -> tuple[dict, str]:
    if args.isolation == "direct":
        isolation = "O_DIRECT chunk I/O: every nvme read and write bypasses the page cache (no cgroup)"
        return run_child(args, argv, "nvme", None), isolation
    if not MemoryCgroup.available():
        isolation = "none: no writable cgroup v1 memory controller, so reads may come from the page cache"
        return run_child(args, argv, "nvme", None), isolation
    with MemoryCgroup(args.memory_limit) as cg:
        result = run_child(args, argv, "nvme", cg)
        result["cgroup_max_usage_GB"] = cg.max_usage_bytes() / GB
    return result, f"memory cgroup v1 limited to {args.memory_limit / GB:.2f} GB (page cache included)"


def raw_bandwidth(args) -> dict[str, float]:
    return raw_direct_io(os.path.join(args.dir, "raw.bin"), args.raw_bytes)


def summary(args, runs: dict, raw: list[dict], isolation: str) -> dict:
    nvme = runs["nvme"]
    read_bw = statistics.mean(r["raw_read_GBps"] for r in raw) * GB
    write_bw = statistics.mean(r["raw_write_GBps"] for r in raw) * GB
    floor = nvme["read_bytes_nvme"] / read_bw + nvme["write_bytes_nvme"] / write_bw
    model = bench_model(args)
    n = parameter_count(model)
    return {
        "reference_step_s": runs["reference"]["step_s"],
        "device_step_s": runs["device"]["step_s"],
        "host_step_s": runs["host"]["step_s"],
        "nvme_step_s": nvme["step_s"],
        "io_floor_s": floor,
        "overlap_efficiency": max(runs["device"]["step_s"], floor) / nvme["step_s"],
        "peak_rss_GB": nvme["peak_rss_GB"],
        "state_GB": n * state_bytes_per_param(args.precision) / GB,
        "precision": args.precision,
        "nvme_isolation": isolation,
        "model": {"arch": model.arch, "d_model": model.d_model, "n_layers": model.n_layers,
                  "vocab_size": model.vocab_size, "params": n},
        "batch": {"batch_size": args.batch_size, "seq_len": args.seq_len, "same batch every step": True},
        "steps_timed": args.steps, "warmup_steps": args.warmup, "statistic": "median of the timed steps",
        "raw_read_GBps": read_bw / GB, "raw_write_GBps": write_bw / GB, "raw_runs": raw,
        "nvme_bytes_per_step": {"read": nvme["read_bytes_nvme"], "write": nvme["write_bytes_nvme"]},
        "peak_rss_GB_per_run": {r: runs[r]["peak_rss_GB"] for r in RUNS},
        "runs": runs,
        "allocator": f"nvme run: {allocator.describe()} (zinfjax.runtime.allocator, as zinfjax train sets it); "
                     "others: glibc defaults",
    }


def state_bytes_per_param(precision: str) -> int:
    """Bytes of training state per parameter with AdamW: the compute copy, fp32 master (mixed), m and v."""
    compute = {"fp32": 4, "bf16": 2, "fp16": 2}[precision]
    return compute + (0 if precision == "fp32" else 4) + 8


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/step", help="directory on the NVMe filesystem (state + raw I/O test)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=32, help="GPT-2 blocks (32 x d_model 512: 101M params)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="fp32, or bf16 mixed precision (bf16 compute copies, fp32 master, m and v: ZeRO-Infinity's "
                   "setting, and DeepSpeed's for NVMe parameter offload)")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--host-buffer-bytes", type=parse_size, default="256MiB")
    p.add_argument("--isolation", choices=["direct", "cgroup"], default="direct",
                   help="keep nvme reads off the page cache by the tier's O_DIRECT I/O, or by a memory cgroup")
    p.add_argument("--memory-limit", type=parse_size, default="1GiB", help="cgroup limit of the nvme run (--isolation "
                   "cgroup)")
    p.add_argument("--raw-bytes", type=parse_size, default="1GiB", help="bytes of each raw O_DIRECT test")
    p.add_argument("--runs", default=",".join(RUNS), help="configurations to run (comma separated)")
    p.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: `zinfjax bench step [--dir PATH]`; prints one JSON object."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    os.makedirs(args.dir, exist_ok=True)
    try:
        raw = [raw_bandwidth(args)]
        runs, isolation = {}, ""
        for run in args.runs.split(","):
            if run == "nvme":
                runs[run], isolation = run_nvme(args, argv)
                shutil.rmtree(os.path.join(args.dir, "state"), ignore_errors=True)
            else:
                runs[run] = run_child(args, argv, run, None)
        raw.append(raw_bandwidth(args))
    finally:
        shutil.rmtree(os.path.join(args.dir, "state"), ignore_errors=True)
    if set(runs) == set(RUNS):
        print(json.dumps(summary(args, runs, raw, isolation)))
    else:
        print(json.dumps({"runs": runs, "raw_runs": raw}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
