"""Soak: ``zinfjax train`` for thousands of steps with every tier on NVMe, sampled from outside; prints JSON.

The run is a child process (``python -m zinfjax.cli train``, ``params=optimizer=gradients=activations=nvme``,
a checkpoint every ``--save-every`` steps, ``keep_checkpoints=--keep``), once per ``--memory-limits`` entry
(``none``: uncapped). This process samples it every ``--interval`` seconds: RSS, its transparent huge pages
(``AnonHugePages``) and its heap's size, open file descriptors, threads (psutil where installed, else /proc),
the bytes allocated under ``nvme_path`` and under ``save_dir`` (hard links counted once). A sample belongs to
the window of ``--save-every`` steps the run is in: the newest checkpoint marker in ``save_dir``
(``<step>`` or ``.tmp-<step>``, made as step ``<step>`` ends) is the window's start. Step times come from
the run's JSON log (``step_s``).

The targets, over the windows after ``--warmup`` steps (the run's tail after its last step, the final
save and shutdown, is left out):

- RSS: the largest RSS of the late windows (the last quarter of the run after warm-up) at most
  ``max(2%, 16 MiB)`` above the largest of the reference window (``warmup`` to ``warmup + save_every``);
  peak against peak, as every window holds one save. ``pass_net_of_huge_pages`` holds RSS to the same
  allowance less the growth of its transparent huge pages, and the heap's address space (``[heap]`` in
  /proc/PID/maps) to the allowance itself: with malloc on huge pages (``zinfjax train``'s default,
  `zinfjax.runtime.allocator`) khugepaged fills the free pages of the heap as it collapses it into huge
  pages, and RSS rises by tens of MiB for minutes, up to the heap's size, with no byte more allocated
  (``--no-huge-pages`` runs without);
- descriptors and threads constant: the descriptors held through each window (open, to the same file, in
  every sample of it; the nvme tier opens and closes its chunk files all the time, and a save opens more
  for a while) and each window's floor of threads never above the window's before (``constant``: all the
  same). A floor may fall: tensorstore's pool ends its idle workers (ten ``ts_pool_worker`` threads, some
  20 s after the state is first written); a leak raises it. The floors, medians and maxima of the counts
  are reported beside;
- disk bounded by the kept checkpoints: ``save_dir`` at most ``keep + 1`` checkpoints (one being written
  while ``keep`` are kept), and ``nvme_path`` at most one checkpoint above its reference window (a save
  stages its chunks there when the checkpoint is on another filesystem);
- step time: the median of the last ``--span`` steps within 5% of the median of steps
  ``warmup`` to ``warmup + span``.

Each run's samples are plotted against step (RSS, descriptors, threads, disk bytes, step time) into
``--plot`` (default ``<dir>/soak.png``); the JSON printed is written beside it (``.json``).

Example:
    $ zinfjax bench soak --dir runs/soak --steps 2000 --memory-limits none,1GiB -o runs/soak/soak.png
    $ python bench/soak.py --model gpt2-tiny --steps 120 --save-every 20 --warmup 20 --span 40 --interval 0.1
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

from zinfjax._util.byte_sizes import parse_bytes
from zinfjax.benchmarks.children import one_device_env

MiB = 1 << 20
NVME = ["params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme"]
RSS_TOLERANCE = (0.02, 16 * MiB)  # relative, absolute: growth allowed is the larger
STEP_TOLERANCE = 0.05
FIGURES = ("rss_bytes", "anon_huge_bytes", "heap_bytes", "fds", "fds_held", "threads", "nvme_bytes", "save_bytes")


# ---- sampling from outside ---------------------------------------------------------------------------------


def process_stats(pid: int) -> dict:
    """RSS, transparent huge pages in it, open descriptors and threads of process ``pid``.

    Example:
        >>> sorted(process_stats(os.getpid()))
        ['anon_huge_bytes', 'fds', 'heap_bytes', 'rss_bytes', 'threads']
    """
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        p = psutil.Process(pid)
        with p.oneshot():
            out = {"rss_bytes": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads()}
    else:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        out = {"rss_bytes": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")),
               "threads": len(os.listdir(f"/proc/{pid}/task"))}
    out["anon_huge_bytes"] = _smaps_field(pid, "AnonHugePages")
    out["heap_bytes"] = heap_bytes(pid)
    return out


def heap_bytes(pid: int) -> int:
    """The size of process ``pid``'s ``[heap]`` mapping (glibc's main arena, grown by ``brk``): its address space,
    not its resident pages, so the kernel's collapsing of it into huge pages leaves it unchanged; 0: none.

    Example:
        >>> heap_bytes(os.getpid()) >= 0
        True
    """
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if line.rstrip().endswith("[heap]"):
                    start, end = line.split()[0].split("-")
                    return int(end, 16) - int(start, 16)
    except OSError:
        pass
    return 0


def _smaps_field(pid: int, name: str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def dir_bytes(path: str) -> int:
    """Bytes allocated on disk under ``path`` (``st_blocks``; each inode once); files removed meanwhile skipped.

    Example:
        >>> dir_bytes("/nonexistent")
        0
    """
    seen, total = set(), 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def marker_step(save_dir: str) -> int:
    """The newest step a checkpoint has been started for in ``save_dir`` (``<step>`` or ``.tmp-<step>``); 0: none.

    Example:
        >>> marker_step("/nonexistent")
        0
    """
    try:
        names = os.listdir(save_dir)
    except OSError:
        return 0
    steps = [int(n.removeprefix(".tmp-")) for n in names if n.removeprefix(".tmp-").isdigit()]
    return max(steps, default=0)


def fd_targets(pid: int) -> set[str]:
    """Process ``pid``'s open descriptors, each as ``"<fd> <what it refers to>"``; those closed meanwhile left out.

    Example:
        >>> any(entry.startswith("0 ") for entry in fd_targets(os.getpid()))
        True
    """
    out = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            out.add(f"{name} {os.readlink(f'/proc/{pid}/fd/{name}')}")
        except OSError:
            continue
    return out


def run_sampled(argv: list[str], env: dict, nvme: str, save_dir: str, workdir: str, interval: float) -> dict:
    """Runs ``argv`` and samples it every ``interval`` seconds until it exits; its exit status, samples, wall, and
    the descriptors held through the last window. Each sample's ``fds_held`` counts the descriptors open in every
    sample of its window so far (the same descriptor to the same file): at the window's last sample, those held
    through it, where the I/O's chunk files, opened and closed all the time, fall away."""
    samples, started, held, marker = [], time.perf_counter(), set(), None
    with open(os.path.join(workdir, "stdout.txt"), "w") as out, open(os.path.join(workdir, "stderr.txt"), "w") as err:
        child = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        try:
            while child.poll() is None:
                step = marker_step(save_dir)  # before the stats: a sample is never ahead of its window
                try:
                    stats, fds = process_stats(child.pid), fd_targets(child.pid)
                except (OSError, ProcessLookupError, ValueError) + _psutil_errors():
                    break  # it has just exited
                held, marker = (held & fds, step) if step == marker else (fds, step)
                samples.append({"t": time.perf_counter() - started, "marker": step, **stats, "fds_held": len(held),
                                "nvme_bytes": dir_bytes(nvme), "save_bytes": dir_bytes(save_dir)})
                time.sleep(interval)
            code = child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    return {"exit_code": code, "wall_s": time.perf_counter() - started, "samples": samples,
            "fds_held_last_window": sorted(held)}


def _psutil_errors() -> tuple:
    try:
        import psutil
    except ImportError:
        return ()
    return (psutil.Error,)


# ---- windows and targets -----------------------------------------------------------------------------------


def windows(samples: list[dict], every: int, steps: int, step_s: list[float]) -> list[dict]:
    """Per window of ``every`` steps (by each sample's checkpoint marker): the floor, median and peak of each
    figure over its samples, and the median step time of its steps; windows without samples are left out."""
    out = []
    for start in range(0, steps, every):
        group = [s for s in samples if s["marker"] == start]
        if not group:
            continue
        w = {"start": start, "samples": len(group),
             "step_s_median": statistics.median(step_s[start:start + every]) if step_s[start:start + every] else None}
        for key in FIGURES:
            values = [s[key] for s in group]
            w[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
        out.append(w)
    return out


def targets(wins: list[dict], step_s: list[float], *, warmup: int, every: int, span: int, keep: int,
            checkpoint_bytes: int) -> dict:
    """The soak's targets (see the module docstring) from the windows and the log's step times, each with pass."""
    after = [w for w in wins if w["start"] >= warmup]
    if not after:
        return {"error": f"no samples after step {warmup}: the run is too short or the sampling too slow"}
    ref = after[0]
    late_from = warmup + 0.75 * (after[-1]["start"] + every - warmup)
    late = [w for w in after if w["start"] + every > late_from] or after[-1:]
    out = {"reference_window": [ref["start"], ref["start"] + every],
           "late_windows": [late[0]["start"], late[-1]["start"] + every]}
    out["rss"] = _rss_target(ref, late)
    for key, floor, compared in (("fds", "fds_held", "per window, the descriptors held through it (open in every "
                                  "sample, to the same file)"), ("threads", "threads", "per-window floor (minimum)")):
        floors = [w[floor]["min"] for w in after]
        out[key] = {"compared": compared, "floor_min": min(floors), "floor_max": max(floors),
                    "min": min(w[key]["min"] for w in after), "median_min": min(w[key]["median"] for w in after),
                    "median_max": max(w[key]["median"] for w in after), "max": max(w[key]["max"] for w in after),
                    "constant": min(floors) == max(floors), "pass": floors == sorted(floors, reverse=True)}
    save_peak = max(w["save_bytes"]["max"] for w in after)
    nvme_growth = max(w["nvme_bytes"]["max"] for w in after) - ref["nvme_bytes"]["max"]
    bound = (keep + 1) * checkpoint_bytes
    out["disk"] = {"checkpoint_bytes": checkpoint_bytes, "save_dir_peak_bytes": save_peak,
                   "save_dir_bound_bytes": bound, "nvme_reference_bytes": ref["nvme_bytes"]["max"],
                   "nvme_growth_bytes": nvme_growth,
                   "pass": checkpoint_bytes > 0 and save_peak <= bound and nvme_growth <= checkpoint_bytes}
    out["step_time"] = _step_target(step_s, warmup, span)
    out["pass"] = all(out[k]["pass"] for k in ("rss", "fds", "threads", "disk", "step_time"))
    out["pass_net_of_huge_pages"] = out["rss"]["net_pass"] and all(
        out[k]["pass"] for k in ("fds", "threads", "disk", "step_time"))
    return out


def _rss_target(ref: dict, late: list[dict]) -> dict:
    """RSS growth against its allowance; and net of the kernel's huge pages (``net_pass``): khugepaged collapsing
    2 MiB of a heap madvised for them (`zinfjax.runtime.allocator`) raises RSS by at most the 2 MiB it adds to
    AnonHugePages and leaves the heap's address space as it was, where a leak grows the heap."""
    level = ref["rss_bytes"]["max"]
    growth = max(w["rss_bytes"]["max"] for w in late) - level
    allowed = max(RSS_TOLERANCE[0] * level, RSS_TOLERANCE[1])
    huge = max(w["anon_huge_bytes"]["max"] for w in late) - ref["anon_huge_bytes"]["max"]
    heap = max(w["heap_bytes"]["max"] for w in late) - ref["heap_bytes"]["max"]
    return {"compared": "peak of the late windows against the peak of the reference window",
            "reference_bytes": level, "growth_bytes": growth, "growth": growth / level, "allowed_bytes": allowed,
            "median_growth_bytes": max(w["rss_bytes"]["median"] for w in late) - ref["rss_bytes"]["median"],
            "anon_huge_growth_bytes": huge, "heap_growth_bytes": heap, "pass": growth <= allowed,
            "net_pass": growth - max(huge, 0) <= allowed and heap <= allowed}


def _step_target(step_s: list[float], warmup: int, span: int) -> dict:
    early, last = step_s[warmup:warmup + span], step_s[-span:]
    if not early or len(step_s) < warmup + span:
        return {"error": f"fewer than {warmup + span} steps", "pass": False}
    ratio = statistics.median(last) / statistics.median(early)
    return {"early_steps": [warmup + 1, warmup + len(early)], "late_steps": [len(step_s) - len(last) + 1, len(step_s)],
            "early_median_s": statistics.median(early), "late_median_s": statistics.median(last),
            "late_over_early": ratio, "pass": abs(ratio - 1) <= STEP_TOLERANCE}


# ---- one run -------------------------------------------------------------------------------------------------


def run_one(label: str, limit: str | None, args) -> dict:
    """One soak run (``limit``: its memory_limit, None uncapped) in ``<dir>/<label>``; its windows and targets."""
    workdir = os.path.join(args.dir, label)
    nvme, save_dir, log = (os.path.join(workdir, name) for name in ("nvme", "ckpt", "log.json"))
    for path in (nvme, save_dir):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    sets = [f"model={args.model}", f"steps={args.steps}", *NVME, f"nvme_path={nvme}", f"save_dir={save_dir}",
            f"save_every={args.save_every}", f"keep_checkpoints={args.keep}", f"log={log}",
            *([f"memory_limit={limit}"] if limit else []), *args.set]
    argv = [sys.executable, "-m", "zinfjax.cli", "train", "--quiet", *(a for s in sets for a in ("--set", s))]
    env = one_device_env()  # one CPU device, as a user's process
    if not args.huge_pages:
        env["ZINFJAX_HUGE_PAGES"] = "0"
    result = run_sampled(argv, env, nvme, save_dir, workdir, args.interval)
    samples = result.pop("samples")
    with open(os.path.join(workdir, "samples.json"), "w") as f:
        json.dump(samples, f)
    out = {"memory_limit": limit, "config": sets, **result, "samples": len(samples), "dir": workdir}
    if result["exit_code"] != 0 or not os.path.exists(log):
        with open(os.path.join(workdir, "stderr.txt")) as f:
            out["error"] = (f.read().strip().splitlines() or [f"exit {result['exit_code']}"])[-1]
        return out
    with open(log) as f:
        steps = json.load(f)["steps"]
    step_s = [s["step_s"] for s in steps]
    newest = marker_step(save_dir)
    checkpoint_bytes = dir_bytes(os.path.join(save_dir, str(newest))) if newest else 0
    wins = windows(samples, args.save_every, args.steps, step_s)
    out.update({"steps_completed": len(steps), "loss_first": steps[0]["loss"], "loss_last": steps[-1]["loss"],
                "checkpoints_left": sorted(int(n) for n in os.listdir(save_dir) if n.isdigit()),
                "windows": wins, "step_s": step_s,
                "targets": targets(wins, step_s, warmup=args.warmup, every=args.save_every, span=args.span,
                                   keep=args.keep, checkpoint_bytes=checkpoint_bytes)})
    if not args.keep_files:
        shutil.rmtree(nvme, ignore_errors=True)
        shutil.rmtree(save_dir, ignore_errors=True)
    return out


def sample_steps(samples: list[dict], every: int) -> list[float]:
    """Each sample's step, interpolated in time within its window (from the first sample of its window to the
    first of the next)."""
    firsts = {}
    for s in samples:
        firsts.setdefault(s["marker"], s["t"])
    markers = sorted(firsts)
    nxt = {m: firsts[n] for m, n in zip(markers, markers[1:], strict=False)}
    out = []
    for s in samples:
        t0, t1 = firsts[s["marker"]], nxt.get(s["marker"])
        frac = (s["t"] - t0) / (t1 - t0) if t1 and t1 > t0 else 0.0
        out.append(s["marker"] + every * min(frac, 1.0))
    return out


def plot(runs: dict, every: int, path: str) -> str:
    """RSS, descriptors, threads, disk bytes and step time against step, one line per run, into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("RSS (MiB)", ["rss_bytes"]), ("open descriptors", ["fds", "fds_held"]), ("threads", ["threads"]),
              ("disk (MiB)", ["nvme_bytes", "save_bytes"])]
    fig, axes = plt.subplots(len(panels) + 1, 1, figsize=(9, 12), dpi=110, sharex=True)
    for label, run in runs.items():
        with open(os.path.join(run["dir"], "samples.json")) as f:
            samples = json.load(f)
        x = sample_steps(samples, every)
        for ax, (title, keys) in zip(axes, panels, strict=False):
            for key in keys:
                scale = MiB if "bytes" in key else 1
                name = label if len(keys) == 1 else f"{label} {key.removesuffix('_bytes')}"
                ax.plot(x, [s[key] / scale for s in samples], linewidth=0.8, label=name)
            ax.set_ylabel(title)
        if run.get("step_s"):
            axes[-1].plot(range(1, len(run["step_s"]) + 1), run["step_s"], linewidth=0.5, alpha=0.6, label=label)
    axes[-1].set_ylabel("step time (s)")
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ---- command line --------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zinfjax bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="runs/soak", help="directory on the NVMe filesystem for the runs")
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--save-every", type=int, default=50, help="checkpoint period, and the sampling window")
    p.add_argument("--keep", type=int, default=3, help="keep_checkpoints")
    p.add_argument("--memory-limits", default="none,1GiB", help="comma-separated memory_limit values, none: uncapped")
    p.add_argument("--warmup", type=int, default=100, help="steps left out of the targets")
    p.add_argument("--span", type=int, default=200, help="steps whose median step time is compared, early and last")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="ZINFJAX_HUGE_PAGES=0: malloc without transparent huge pages")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more zinfjax train settings")
    p.add_argument("--keep-files", action="store_true", help="leave nvme_path and save_dir in place")
    p.add_argument("-o", "--plot", help="the PNG (default <dir>/soak.png); the JSON is written beside it")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command line: ``zinfjax bench soak [--steps N] [--memory-limits none,1GiB] [-o PNG]``; prints one JSON object."""
    args = parser().parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    runs = {}
    for limit in args.memory_limits.split(","):
        capped = limit.strip().lower() not in ("", "none")
        if capped:
            parse_bytes(limit)  # refused here, before a run starts, if it is not a size
        label = f"memory_limit={limit.strip()}" if capped else "uncapped"
        runs[label] = run_one(label.replace("=", "-"), limit.strip() if capped else None, args)
    path = args.plot or os.path.join(args.dir, "soak.png")
    plot(runs, args.save_every, path)
    for run in runs.values():
        run.pop("step_s", None)  # plotted; the log has them
    out = {"model": args.model, "steps": args.steps, "save_every": args.save_every, "keep_checkpoints": args.keep,
           "warmup": args.warmup, "span": args.span, "interval_s": args.interval, "huge_pages": args.huge_pages,
           "plot": path, "runs": runs,
           "pass": all(r.get("targets", {}).get("pass", False) for r in runs.values()),
           "pass_net_of_huge_pages": all(r.get("targets", {}).get("pass_net_of_huge_pages", False)
                                         for r in runs.values())}
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
