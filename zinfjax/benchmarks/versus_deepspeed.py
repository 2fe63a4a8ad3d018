"""Versus DeepSpeed: GPT-2 small under DeepSpeed ZeRO-3 and under `zinfjax train`, tier by tier.

One invocation runs, one after another and each in its own process, for fp32 and for bf16:

- DeepSpeed (zinfjax/benchmarks/deepspeed_step.py): Hugging Face ``GPT2LMHeadModel`` under ZeRO-3
  on the CPU accelerator with libaio: ``nvme`` (parameters and optimizer state offloaded to NVMe,
  ``max_in_cpu`` at DeepSpeed's default of 1e9 elements, so the parameters stay in RAM),
  ``nvme_params_on_disk`` (the same with ``max_in_cpu`` small, so they leave RAM) and ``cpu``
  (both offloaded to CPU memory);
- zinfjax, through the user's path, ``zinfjax train --set model=gpt2-small ...`` with default
  settings otherwise: ``nvme`` (params, optimizer and activations on NVMe), ``nvme_optimizer``
  (DeepSpeed's ``nvme`` placement as it runs: parameters on host, optimizer state on NVMe), ``host``
  (every tier on host) and ``memory`` (every tier on device: stage 0, the plain in-memory JAX step);
- raw disk bandwidth (sequential O_DIRECT, `zinfjax.benchmarks.io.raw_direct_io`) on the same
  directory before and after, and from it the I/O floor of one zinfjax NVMe step: the bytes its
  log reports over that bandwidth.

Same batch (4 x 128 tokens by default), AdamW (lr 3e-4, no weight decay), same NVMe directory.
Each run reports the median of its steps after ``--warmup`` (steps 3 to 8 by default), its
peak RSS (VmHWM, zinfjax/benchmarks/process.py), its memory cgroup's peak when a cgroup v1 memory
controller is writable, its initialisation time (process start to the first step's start), and
how many CPU cores other processes kept busy meanwhile (``other_cpu_cores``: the machine is shared).
A DeepSpeed configuration that crashes is recorded as ``{"error": "<its message>"}``; without
DeepSpeed, or without libaio, the zinfjax side still runs and the JSON says what was skipped.

Example:
    $ python bench/versus_deepspeed.py --dir runs/versus-deepspeed
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from zinfjax.benchmarks.cgroup import MemoryCgroup
from zinfjax.benchmarks.children import one_device_env
from zinfjax.benchmarks.deepspeed_step import CONSTRUCTIONS, ds_config
from zinfjax.benchmarks.io import parse_size, raw_direct_io
from zinfjax.errors import UserError
from zinfjax.runtime.allocator import with_huge_pages
from zinfjax.runtime.cpu_load import machine_busy_s, own_cpu_s

GB = 1e9
PRECISIONS = ("fp32", "bf16")
ZINFJAX_TIERS = {  # run -> the tiers it sets; the others keep their default (device)
    "nvme": {"params": "nvme", "optimizer": "nvme", "activations": "nvme"},
    # DeepSpeed's "nvme" run as it places its state here: the parameters in RAM (max_in_cpu), the
    # optimizer state and fp32 master on NVMe
    "nvme_optimizer": {"params": "host", "optimizer": "nvme"},
    "host": {"params": "host", "optimizer": "host", "gradients": "host", "activations": "host"},
    "memory": {},
    "auto": {},  # tiers=auto: an nvme_path and no tier key; the plan places the state within --memory-limit
}
DEFAULT_ZINFJAX_RUNS = ("nvme", "nvme_optimizer", "host", "memory")
DEEPSPEED_RUNS = ("nvme", "nvme_params_on_disk", "cpu")


# ---- running one child -------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """The children's environment: this one on one CPU device, with DeepSpeed on its CPU accelerator."""
    env = one_device_env()
    return env | {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}


def zinfjax_env() -> dict[str, str]:
    """The environment of a zinfjax run: `child_env` with malloc on transparent huge pages, as the ``zinfjax``
    command gives itself (`zinfjax.runtime.allocator.restart_with_huge_pages`). DeepSpeed's runs get `child_env`."""
    env = child_env()
    return with_huge_pages(env) or env


def run_measured(args, module_argv: list[str], imports: tuple[str, ...] = (), env: dict | None = None) -> dict:
    """Runs ``python -m MODULE ...`` under zinfjax.benchmarks.process, in a memory cgroup when one is writable,
    in ``env`` (default: `child_env`).

    Returns its exit status, stdout, the tail of its stderr, wall time, its own report (peak RSS,
    start-up) and, in a cgroup, the group's peak usage and OOM kills.
    """
    fd, report = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "zinfjax.benchmarks.process", report,
           *[a for name in imports for a in ("--import", name)], *module_argv]
    cgroup = MemoryCgroup(args.memory_limit or -1) if MemoryCgroup.available() else None
    with cgroup or contextlib.nullcontext():
        out = run_child(cgroup.command(cmd) if cgroup else cmd, args.timeout, env)
        if cgroup is not None:
            out |= {"cgroup_max_usage_bytes": cgroup.max_usage_bytes(), "cgroup_oom_kills": cgroup.oom_kills()}
    return out | {"report": read_report(report)}


def run_child(cmd: list[str], timeout: int, env: dict | None = None) -> dict:
    """Runs ``cmd`` to its end or ``timeout``: exit status (None on timeout), stdout, stderr's tail, wall time.

    ``other_cpu_cores``: the CPU cores that processes other than this benchmark and its child kept
    busy on average while the child ran (from /proc/stat), a measure of how shared the machine was.
    """
    busy0, own0, start = machine_busy_s(), own_cpu_s(), time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env or child_env(), capture_output=True, text=True, timeout=timeout)
        out = {"exit": proc.returncode, "stdout": proc.stdout, "stderr_tail": proc.stderr[-4000:]}
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out = {"exit": None, "stdout": stdout, "stderr_tail": "", "timed_out": True}
    wall = time.perf_counter() - start
    other = (machine_busy_s() - busy0) - (own_cpu_s() - own0)
    return out | {"wall_s": wall, "other_cpu_cores": max(0.0, other / wall)}




def read_report(path: str) -> dict:
    """The child's own report (peak RSS, start-up), or {} when it died before writing it."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
    finally:
        if os.path.exists(path):
            os.remove(path)


def last_json(text: str) -> dict | None:
    """The JSON object on the last line of ``text`` that holds one, else None.

    Example:
        >>> last_json('noise\\n{"a": 1}\\n')
        {'a': 1}
    """
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def failure(args, child: dict) -> str:
    """One line that says why a child failed: its own error, the OOM killer, a signal, a timeout."""
    if child.get("timed_out"):
        return f"timed out after {args.timeout} s"
    if child.get("cgroup_oom_kills"):
        limit = f"{args.memory_limit / 2**30:.2f} GiB" if args.memory_limit else "no limit"
        return f"killed by the memory cgroup's OOM killer (limit {limit})"
    code = child["exit"]
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    own = last_json(child["stdout"])
    if own and "error" in own:
        return own["error"]
    lines = [line for line in child["stderr_tail"].splitlines() if line.strip()]
    return f"exit {code}: {lines[-1].strip() if lines else 'no message'}"


def memory_figures(child: dict) -> dict:
    """Peak RSS (GB) of the child, and its cgroup's peak (page cache included) when it ran in one."""
    out = {"peak_rss_GB": child["report"].get("peak_rss_bytes", 0) / GB}
    if "cgroup_max_usage_bytes" in child:
        out["cgroup_max_usage_GB"] = child["cgroup_max_usage_bytes"] / GB
    return out


def timed_median(args, times: list[float]) -> float:
    """The median of the steps after the warm-up (steps 3 and later by default)."""
    return statistics.median(times[args.warmup:])


# ---- zinfjax -----------------------------------------------------------------------------------


def zinfjax_overrides(args, run: str, precision: str, log: str) -> list[str]:
    """The ``--set`` overrides of one zinfjax run; every other key keeps its default."""
    values = {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps,
              **ZINFJAX_TIERS[run], "precision": precision, "log": log}
    if "nvme" in ZINFJAX_TIERS[run].values() or run == "auto":
        values["nvme_path"] = nvme_dir(args)
    if run == "auto" and args.memory_limit:
        values["memory_limit"] = args.memory_limit
    return [f"{k}={v}" for k, v in values.items()]


def zinfjax_command(overrides: list[str]) -> str:
    """The command a user types for this run."""
    return "zinfjax train --quiet " + " ".join(f"--set {o}" for o in overrides)


def run_zinfjax(args, run: str, precision: str) -> dict:
    """One ``zinfjax train`` run in its own process: step times from its JSON log, memory, init time."""
    reset_nvme_dir(args)
    log_path = os.path.join(args.dir, f"zinfjax-{run}-{precision}.json")
    overrides = zinfjax_overrides(args, run, precision, log_path)
    child = run_measured(args, ["zinfjax.cli", "train", "--quiet", *[a for o in overrides for a in ("--set", o)]],
                         imports=("zinfjax.training.loop",), env=zinfjax_env())
    if child["exit"] != 0:
        return {"error": failure(args, child), "command": zinfjax_command(overrides)}
    with open(log_path) as f:
        log = json.load(f)
    steps = log["steps"]
    tokens = args.batch_size * args.seq_len
    times = [s["step_s"] if "step_s" in s else tokens / s["tokens_per_s"] for s in steps]
    out = {"step_s": timed_median(args, times), "step_times_s": times, "losses": [s["loss"] for s in steps],
           **memory_figures(child), "init_s": child["report"]["startup_s"] + log["init_s"],
           "startup_s": child["report"]["startup_s"], "setup_s": log["init_s"], "process_wall_s": child["wall_s"],
           "other_cpu_cores": child["other_cpu_cores"], "malloc_huge_pages": log.get("malloc_huge_pages"),
           "step_s_from": "the log's step_s (engine)" if "step_s" in steps[0] else
           "batch_size * seq_len / tokens_per_s of the log (the in-memory trainer logs no step_s)",
           "command": zinfjax_command(overrides)}
    for key in ("read_bytes_nvme", "write_bytes_nvme"):
        if key in steps[0]:
            out[key] = statistics.median(s[key] for s in steps[args.warmup:])
    os.remove(log_path)
    return out


# ---- DeepSpeed ---------------------------------------------------------------------------------


def deepspeed_configs(args, precision: str) -> dict[str, dict]:
    """The DeepSpeed JSON config of each DeepSpeed run at this precision."""
    return {
        "nvme": ds_config("nvme", precision, args.batch_size, nvme_dir(args), sub_group_size=args.sub_group_size),
        "nvme_params_on_disk": ds_config("nvme", precision, args.batch_size, nvme_dir(args),
                                         max_in_cpu=args.max_in_cpu, sub_group_size=args.sub_group_size),
        "cpu": ds_config("cpu", precision, args.batch_size, sub_group_size=args.sub_group_size),
    }


def model_shape(args) -> dict:
    """The Hugging Face GPT-2 shape of ``args.model`` (a zinfjax gpt2 size)."""
    from zinfjax.checkpoint.model import resolve_model

    try:
        m = resolve_model(args.model)
    except UserError as e:
        raise SystemExit(f"zinfjax bench versus-deepspeed: {e}") from e
    if m.arch != "gpt2":
        raise SystemExit(f"zinfjax bench versus-deepspeed: --model must be a GPT-2 size, not {args.model} ({m.arch})")
    return {"vocab_size": m.vocab_size, "n_positions": m.max_seq_len, "n_embd": m.d_model, "n_layer": m.n_layers,
            "n_head": m.n_heads}


def deepspeed_argv(args, config_path: str) -> list[str]:
    shape = model_shape(args)
    return ["zinfjax.benchmarks.deepspeed_step", "--config", config_path, "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--construct", args.construct,
            *[a for k, v in shape.items() for a in (f"--{k.replace('_', '-')}", str(v))]]


def run_deepspeed(args, config: dict) -> dict:
    """One DeepSpeed configuration in its own process; ``{"error": ...}`` when it crashes or is killed."""
    reset_nvme_dir(args)
    config_path = os.path.join(args.dir, "ds_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    child = run_measured(args, deepspeed_argv(args, config_path))
    result = last_json(child["stdout"]) if child["exit"] == 0 else None
    if result is None or "step_times_s" not in result:
        return {"error": failure(args, child)}
    times = result["step_times_s"]
    return {"step_s": timed_median(args, times), "step_times_s": times, "losses": result["losses"],
            **memory_figures(child), "init_s": result["init_s"], "startup_s": result["startup_s"],
            "model_build_s": result["model_build_s"], "initialize_s": result["initialize_s"],
            "process_wall_s": child["wall_s"], "other_cpu_cores": child["other_cpu_cores"], "params": result["params"],
            "torch_threads": result["torch_threads"]}


def probe_deepspeed(args) -> dict:
    """What DeepSpeed can run here: ``{"skipped": why}`` for all of it, else the probe's figures.

    The probe also builds DeepSpeed's CPU Adam and async I/O ops once (JIT, cached), so that no
    run's initialisation time holds their compilation.
    """
    if args.only == "zinfjax":
        return {"skipped": "--only zinfjax"}
    for name in ("deepspeed", "transformers", "torch"):
        if importlib.util.find_spec(name) is None:
            return {"skipped": f"{name} is not installed (pip install -e '.[dev]' installs DeepSpeed, "
                               "transformers and torch)"}
    child = run_measured(args, ["zinfjax.benchmarks.deepspeed_step", "--probe"])
    probe = last_json(child["stdout"]) if child["exit"] == 0 else None
    if probe is None:
        return {"skipped": f"the DeepSpeed probe failed: {failure(args, child)}"}
    if not probe["importable"]:
        return {"skipped": probe["reason"]}
    return probe


def deepspeed_side(args, probe: dict, precision: str) -> dict:
    """Every DeepSpeed run at one precision, or what was skipped and why."""
    if "skipped" in probe:
        return {run: {"skipped": probe["skipped"]} for run in args.deepspeed_runs}
    out = {}
    for run, config in deepspeed_configs(args, precision).items():
        if run not in args.deepspeed_runs:
            continue
        if run.startswith("nvme") and not probe["async_io"]:
            out[run] = {"skipped": probe["async_io_reason"]}
        else:
            out[run] = run_deepspeed(args, config)
        log_progress(f"deepspeed {run} {precision}", out[run])
    return out


# ---- the disk, the floor and the ratios --------------------------------------------------------


def nvme_dir(args) -> str:
    return os.path.join(os.path.abspath(args.dir), "nvme")


def reset_nvme_dir(args) -> None:
    shutil.rmtree(nvme_dir(args), ignore_errors=True)
    os.makedirs(nvme_dir(args))


def raw_disk(args) -> dict:
    return raw_direct_io(os.path.join(args.dir, "raw.bin"), args.raw_bytes)


def io_floor(zinfjax_nvme: dict, raw: list[dict]) -> dict:
    """The I/O floor of one zinfjax NVMe step: its bytes over the raw bandwidth (mean of before and after)."""
    if "read_bytes_nvme" not in zinfjax_nvme or not raw:
        return {}
    read_bw = statistics.mean(r["raw_read_GBps"] for r in raw) * GB
    write_bw = statistics.mean(r["raw_write_GBps"] for r in raw) * GB
    floor = zinfjax_nvme["read_bytes_nvme"] / read_bw + zinfjax_nvme["write_bytes_nvme"] / write_bw
    return {"io_floor_s": floor, "read_GB_per_step": zinfjax_nvme["read_bytes_nvme"] / GB,
            "write_GB_per_step": zinfjax_nvme["write_bytes_nvme"] / GB,
            "zinfjax_nvme_step_over_io_floor": zinfjax_nvme["step_s"] / floor}


def ratio(a: dict, b: dict, key: str = "step_s") -> float | None:
    return a[key] / b[key] if key in a and key in b and b[key] else None


def best_nvme(deepspeed: dict) -> tuple[str | None, dict]:
    """DeepSpeed's fastest NVMe configuration that ran."""
    working = {k: v for k, v in deepspeed.items() if k.startswith("nvme") and "step_s" in v}
    if not working:
        return None, {}
    name = min(working, key=lambda k: working[k]["step_s"])
    return name, working[name]


def ratios(zinfjax: dict, deepspeed: dict) -> dict:
    """Step time and peak RSS ratios, all from this run; None where a side did not run."""
    best, ds_nvme = best_nvme(deepspeed)
    z_nvme, z_host, z_mem = zinfjax.get("nvme", {}), zinfjax.get("host", {}), zinfjax.get("memory", {})
    z_like = zinfjax.get("nvme_optimizer", {})
    ds_cpu, ds_disk = deepspeed.get("cpu", {}), deepspeed.get("nvme_params_on_disk", {})
    out = {
        "deepspeed_best_nvme": best,
        "zinfjax_nvme_over_deepspeed_best_nvme": ratio(z_nvme, ds_nvme),
        "zinfjax_nvme_over_deepspeed_nvme_params_on_disk": ratio(z_nvme, ds_disk),
        "zinfjax_nvme_over_zinfjax_memory": ratio(z_nvme, z_mem),
        "zinfjax_host_over_zinfjax_memory": ratio(z_host, z_mem),
        "zinfjax_host_over_deepspeed_cpu": ratio(z_host, ds_cpu),
        "zinfjax_nvme_optimizer_over_deepspeed_nvme": ratio(z_like, deepspeed.get("nvme", {})),
        "peak_rss_zinfjax_nvme_over_deepspeed_best_nvme": ratio(z_nvme, ds_nvme, "peak_rss_GB"),
        "peak_rss_zinfjax_host_over_deepspeed_cpu": ratio(z_host, ds_cpu, "peak_rss_GB"),
        "init_zinfjax_nvme_over_deepspeed_best_nvme": ratio(z_nvme, ds_nvme, "init_s"),
    }
    return out


def log_progress(name: str, result: dict) -> None:
    """One line on stderr per run, so a 20-minute benchmark shows where it is."""
    text = (f"{result['step_s']:.2f} s/step, peak RSS {result['peak_rss_GB']:.2f} GB, other processes kept "
            f"{result['other_cpu_cores']:.2f} cores busy" if "step_s" in result
            else result.get("error") or result.get("skipped"))
    print(f"versus-deepspeed: {name}: {text}", file=sys.stderr, flush=True)


# ---- the benchmark -----------------------------------------------------------------------------


def one_precision(args, probe: dict, precision: str) -> dict:
    """Every run at one precision (DeepSpeed first, then zinfjax), the I/O bytes and the ratios."""
    deepspeed = deepspeed_side(args, probe, precision)
    zinfjax = {}
    for run in args.zinfjax_runs:
        zinfjax[run] = {"skipped": "--only deepspeed"} if args.only == "deepspeed" else run_zinfjax(args, run,
                                                                                                    precision)
        log_progress(f"zinfjax {run} {precision}", zinfjax[run])
    return {"deepspeed": deepspeed, "zinfjax": zinfjax, "ratios": ratios(zinfjax, deepspeed)}


def machine() -> dict:
    import jax

    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    return {"cpus": os.cpu_count(), "memory_GB": round(mem / GB, 2), "python": platform.python_version(),
            "jax": jax.__version__, "kernel": platform.release()}


def skipped(result: dict) -> list[str]:
    """Every run that did not run, and why, in one list."""
    return sorted({f"{side} {run}: {r['skipped']}" for p in PRECISIONS if p in result
                   for side in ("deepspeed", "zinfjax") for run, r in result[p][side].items() if "skipped" in r})


def run_list(known: tuple[str, ...]):
    """An argparse type: a comma-separated subset of ``known``, in the order given.

    Example:
        >>> run_list(("nvme", "host"))("host,nvme")
        ('host', 'nvme')
    """
    def parse(text: str) -> tuple[str, ...]:
        runs = tuple(r.strip() for r in text.split(",") if r.strip())
        unknown = [r for r in runs if r not in known]
        if unknown or not runs:
            raise argparse.ArgumentTypeError(f"{text!r}: choose among {', '.join(known)}")
        return runs
    return parse


def rounded(value, digits: int = 6):
    """Floats in a JSON-like value rounded to ``digits`` significant digits (a config's 1e-8 stays 1e-8).

    Example:
        >>> rounded({"a": [1.23456789, 2], "eps": 1e-8})
        {'a': [1.23457, 2], 'eps': 1e-08}
    """
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench versus-deepspeed", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/versus-deepspeed", help="directory on the NVMe filesystem: both sides' "
                   "offloaded state (DIR/nvme), the raw disk test and the logs")
    p.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--only", choices=["zinfjax", "deepspeed"], help="run one side only")
    p.add_argument("--zinfjax-runs", type=run_list(tuple(ZINFJAX_TIERS)), default=DEFAULT_ZINFJAX_RUNS,
                   help="zinfjax runs, comma separated (default nvme,nvme_optimizer,host,memory; auto: tiers=auto "
                   "within --memory-limit)")
    p.add_argument("--deepspeed-runs", type=run_list(DEEPSPEED_RUNS), default=DEEPSPEED_RUNS,
                   help="DeepSpeed runs, comma separated (default nvme,nvme_params_on_disk,cpu)")
    p.add_argument("--steps", type=int, default=8, help="steps per run (default 8: with every tier on host, "
                   "zinfjax's first 3-4 steps fault in its memory, so 5 steps' median is not its steady step)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (default 2: the "
                   "median is of steps 3 and later)")
    p.add_argument("--model", default="gpt2-small", help="a zinfjax GPT-2 size; DeepSpeed trains the same shape")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-in-cpu", type=int, default=10**6, help="DeepSpeed offload_param.max_in_cpu of the "
                   "nvme_params_on_disk run, in elements (default 1e6: GPT-2 small has 124M)")
    p.add_argument("--sub-group-size", type=int, help="DeepSpeed zero_optimization.sub_group_size of every run, in "
                   "elements (default: DeepSpeed's 1e9, which swaps the whole optimizer state of a model under 1e9 "
                   "parameters into RAM at once; 1e8 lets GPT-2 large train on NVMe)")
    p.add_argument("--construct", choices=CONSTRUCTIONS, default="zero-init", help="how DeepSpeed's model is "
                   "built: inside deepspeed.zero.Init (default) or plainly in RAM")
    p.add_argument("--memory-limit", type=parse_size, help="memory cgroup limit of every run (default: none; "
                   "the cgroup still measures each run's peak)")
    p.add_argument("--raw-bytes", type=parse_size, default="1GiB", help="bytes of each raw O_DIRECT test")
    p.add_argument("--timeout", type=int, default=1200, help="seconds before a run is stopped and recorded as an "
                   "error")
    return p


def run_all(args, precisions: tuple[str, ...]) -> dict:
    """The raw disk before, every run of every precision, the raw disk after; the NVMe directory removed."""
    result: dict = {}
    try:
        raw = [raw_disk(args)]
        probe = probe_deepspeed(args)
        for precision in precisions:
            result[precision] = one_precision(args, probe, precision)
        raw.append(raw_disk(args))
    finally:
        shutil.rmtree(nvme_dir(args), ignore_errors=True)
    for precision in precisions:
        result[precision]["io_floor"] = io_floor(result[precision]["zinfjax"].get("nvme", {}), raw)
    result["deepspeed"] = {k: v for k, v in probe.items() if k != "importable"}
    result["raw_disk"] = {"read_GBps": statistics.mean(r["raw_read_GBps"] for r in raw),
                          "write_GBps": statistics.mean(r["raw_write_GBps"] for r in raw), "runs": raw,
                          "method": "O_DIRECT, 1 MiB blocks, 16 in flight, fsync; mean of before and after"}
    return result


def setup(args, precisions: tuple[str, ...]) -> dict:
    """What every run shares: model, batch, statistic, directories, DeepSpeed's configs and model."""
    configs = {p: {k: v for k, v in deepspeed_configs(args, p).items() if k in args.deepspeed_runs}
               for p in precisions}
    return {
        "model": args.model, "batch": {"batch_size": args.batch_size, "seq_len": args.seq_len},
        "steps": args.steps, "statistic": f"median of steps {args.warmup + 1}..{args.steps} of each run",
        "nvme_dir": nvme_dir(args),
        "memory_cgroup": "every run in its own cgroup v1 memory group, limit "
        + (f"{args.memory_limit / 2**30:.2f} GiB" if args.memory_limit else "none")
        if MemoryCgroup.available() else "none: no writable cgroup v1 memory controller",
        "deepspeed_model": {"class": "transformers.GPT2LMHeadModel", "construct": args.construct,
                            "config": {**model_shape(args), "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                       "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5}},
        "deepspeed_configs": configs,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: `zinfjax bench versus-deepspeed [--dir PATH]`; prints one JSON object."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.steps <= args.warmup:
        raise SystemExit(f"zinfjax bench versus-deepspeed: --steps ({args.steps}) must exceed --warmup "
                         f"({args.warmup}): the median is of the steps after the warm-up")
    model_shape(args)  # a model that is not a GPT-2 size fails here, before any run
    os.makedirs(args.dir, exist_ok=True)
    precisions = PRECISIONS if args.precision == "both" else (args.precision,)
    result = {"benchmark": "versus-deepspeed", "command": "zinfjax bench versus-deepspeed " + " ".join(argv),
              "machine": machine(), **setup(args, precisions), **run_all(args, precisions)}
    result["skipped"] = skipped(result)
    print(json.dumps(rounded(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
