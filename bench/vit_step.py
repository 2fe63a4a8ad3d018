"""ViT step benchmark: the ViT example through `zinfjax.wrap` on NVMe against the plain in-memory loop.

The model is examples/vit_linen.py's own (ViT-B/16 widths: 768 x 12 blocks, 86M parameters at
the default 64 x 64 images, so that a step takes seconds on a CPU). Each configuration runs in
its own process, on the same batch every step:

- ``memory``: the Flax user's plain loop, ``jax.jit`` of ``state.apply_gradients(grads=jax.grad(loss_fn)(...))``;
- ``device``: ``zinfjax.wrap`` with every tier on device memory (the engine's compute alone);
- ``nvme``: ``zinfjax.wrap`` with params, optimizer state and activations on NVMe (O_DIRECT I/O).

Raw disk bandwidth is measured on the same directory; ``io_floor_s`` is the NVMe step's bytes over
it, and ``overlap_efficiency = max(device_step_s, io_floor_s) / nvme_step_s``, as `zinfjax bench
step` defines it. Prints one JSON object.

Example:
    $ .venv/bin/python bench/vit_step.py --dir runs/vit_step
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from zinfjax.benchmarks.children import one_device_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("memory", "device", "nvme")


def example():
    spec = importlib.util.spec_from_file_location("vit_linen", os.path.join(ROOT, "examples", "vit_linen.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["vit_linen"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def vit_config(args):
    vit = example()
    return dataclasses.replace(vit.SIZES["base"], image=args.image), vit


def time_memory(args, batch) -> tuple[list[float], list[float]]:
    import jax
    import optax

    config, vit = vit_config(args)
    state, _ = vit.make_state(config, optax.adamw(1e-3, weight_decay=0.01))
    loss_fn = vit.make_loss(state)

    @jax.jit
    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        state, loss = step(state, batch)
        losses.append(float(loss))  # waits for the step
        times.append(time.perf_counter() - start)
    return times, losses


def time_wrapped(args, batch, tier: str) -> tuple[list[float], list[float], list[dict]]:
    import optax

    import zinfjax

    config, vit = vit_config(args)
    state, init_fn = vit.make_state(config, optax.adamw(1e-3, weight_decay=0.01), abstract=True)
    run = zinfjax.Config(params=tier, optimizer=tier, activations=tier, mesh="data:1",
                         nvme_path=os.path.join(args.dir, "state"))
    metrics = []
    with zinfjax.wrap(state, run, loss_fn=vit.make_loss(state), init_fn=init_fn) as wrapped:
        for _ in range(args.warmup + args.steps):
            wrapped, m = wrapped.train_step(batch)
            metrics.append(m)
    return [m["step_s"] for m in metrics], [m["loss"] for m in metrics], metrics


def param_count(vit, config) -> int:
    import jax
    import optax

    _, init_fn = vit.make_state(config, optax.sgd(0.1), abstract=True)
    return sum(x.size for x in jax.tree.leaves(jax.eval_shape(init_fn, jax.random.key(0))))


def child(args) -> dict:
    config, vit = vit_config(args)
    batch = vit.batch_of(config, args.batch_size, 0)
    if args.child == "memory":
        times, losses = time_memory(args, batch)
        metrics = []
    else:
        times, losses, metrics = time_wrapped(args, batch, args.child)
    from zinfjax.runtime.rss import peak_bytes

    out = {"step_s": statistics.median(times[args.warmup:]), "step_times_s": [round(t, 3) for t in times],
           "losses": [round(x, 4) for x in losses], "peak_rss_GB": peak_bytes() / 1e9}
    if metrics:
        last = metrics[-1]
        out |= {k: statistics.median(m[k] for m in metrics[args.warmup:]) for k in ("stall_s", "compute_s")}
        out |= {k: v for k, v in last.items() if k.startswith(("read_bytes_", "write_bytes_"))}
    return out


def run_child(argv: list[str], run: str) -> dict:
    env = one_device_env()  # one CPU device, as a user's process
    out = subprocess.run([sys.executable, __file__, *argv, "--child", run], env=env, capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the {run} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parent(args, argv: list[str]) -> dict:
    from zinfjax.benchmarks.io import raw_direct_io

    os.makedirs(args.dir, exist_ok=True)
    raw = [raw_direct_io(os.path.join(args.dir, "raw.bin"), 256 << 20)]
    runs = {run: run_child(argv, run) for run in RUNS}
    raw.append(raw_direct_io(os.path.join(args.dir, "raw.bin"), 256 << 20))
    shutil.rmtree(args.dir, ignore_errors=True)
    read_bw = statistics.mean(r["raw_read_GBps"] for r in raw) * 1e9
    write_bw = statistics.mean(r["raw_write_GBps"] for r in raw) * 1e9
    nvme = runs["nvme"]
    floor = nvme["read_bytes_nvme"] / read_bw + nvme["write_bytes_nvme"] / write_bw
    config, vit = vit_config(args)
    n = param_count(vit, config)
    return {
        "memory_step_s": runs["memory"]["step_s"], "device_step_s": runs["device"]["step_s"],
        "nvme_step_s": nvme["step_s"], "nvme_over_memory": nvme["step_s"] / runs["memory"]["step_s"],
        "io_floor_s": floor, "overlap_efficiency": max(runs["device"]["step_s"], floor) / nvme["step_s"],
        "params": n, "state_GB": 16 * n / 1e9, "model": dataclasses.asdict(config),
        "batch_size": args.batch_size, "steps_timed": args.steps, "warmup_steps": args.warmup,
        "statistic": "median of the timed steps", "raw_read_GBps": read_bw / 1e9, "raw_write_GBps": write_bw / 1e9,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/vit_step", help="directory on the NVMe filesystem")
    p.add_argument("--image", type=int, default=64, help="image side in pixels (ViT-B/16 patches of 16)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    print(json.dumps(parent(args, argv), indent=1))


if __name__ == "__main__":
    main()
