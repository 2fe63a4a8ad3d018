"""Runs in a memory cgroup (v1), and ``zinfjax train`` in one: what the memory benchmarks measure.

Example (as root, with cgroup v1's memory controller at /sys/fs/cgroup/memory):
    >>> with MemoryCgroup(2 << 30) as cg:
    ...     child = subprocess.run(cg.command([sys.executable, "-c", "b = bytearray(64 << 20)"]))
    ...     cg.max_usage_bytes() > 64 << 20, cg.oom_kills()
    (True, 0)

`train_in_cgroup` runs ``zinfjax train`` so (it drops the machine's page cache first, so that the run is charged for
what it reads, and trains for a minute or more):

    >>> sets = ["model=gpt2-small", "steps=5", "params=nvme", "nvme_path=/mnt/nvme/mem"]
    >>> train_in_cgroup(sets, 1 << 30, "runs/mem")["oom_kills"]  # doctest: +SKIP
    0
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from zinfjax.benchmarks.children import one_device_env

CGROUP_ROOT = "/sys/fs/cgroup/memory"


class MemoryCgroup:
    """A cgroup v1 memory group limited to ``limit`` bytes (page cache included); removed on exit."""

    def __init__(self, limit: int, name: str | None = None):
        self.limit = limit
        self.path = os.path.join(CGROUP_ROOT, name or f"zinfjax_bench_{os.getpid()}_{time.monotonic_ns()}")

    @staticmethod
    def available() -> bool:
        return os.access(CGROUP_ROOT, os.W_OK)

    def __enter__(self) -> MemoryCgroup:
        os.mkdir(self.path)
        self._set("memory.limit_in_bytes", self.limit)
        return self

    def __exit__(self, *exc) -> None:
        for _ in range(50):  # the group can be removed only once its last task is reaped
            try:
                os.rmdir(self.path)
                return
            except OSError:
                time.sleep(0.1)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped so that it runs inside the group from its first instruction."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.path, *argv]

    def max_usage_bytes(self) -> int:
        return int(self._get("memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        fields = dict(line.split() for line in self._get("memory.oom_control").splitlines())
        return int(fields.get("oom_kill", 0))

    def _set(self, key: str, value) -> None:
        with open(os.path.join(self.path, key), "w") as f:
            f.write(str(value))

    def _get(self, key: str) -> str:
        with open(os.path.join(self.path, key)) as f:
            return f.read()


def disk_read_bytes() -> int:
    """Bytes this process has had fetched from storage (page-cache hits excluded), from /proc/self/io."""
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["read_bytes"])


def drop_caches() -> None:
    """Writes dirty pages back and drops the page cache, so a run starts cold and is charged for what it reads."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def train_in_cgroup(sets: list[str], limit: int, workdir: str, timeout: float = 3600) -> dict:
    """``zinfjax train --set KEY=VALUE ...`` in a fresh process inside a ``limit``-byte memory cgroup.

    Returns the run's figures from its JSON log (losses, init time, peak RSS of initialisation and
    of every step, bytes moved) and the cgroup's (peak usage, page cache included; OOM kills). A
    run that fails is reported as ``{"error": ...}`` with the same cgroup figures.
    """
    os.makedirs(workdir, exist_ok=True)
    log = os.path.join(workdir, "log.json")
    if os.path.exists(log):
        os.remove(log)
    argv = [sys.executable, "-m", "zinfjax.cli", "train", "--quiet"]
    argv += [a for s in [*sets, f"log={log}"] for a in ("--set", s)]
    env = one_device_env()  # one CPU device, as a user's process
    drop_caches()
    started = time.perf_counter()
    with MemoryCgroup(limit) as cg:
        out = subprocess.run(cg.command(argv), env=env, capture_output=True, text=True, timeout=timeout)
        usage, ooms = cg.max_usage_bytes(), cg.oom_kills()
    figures = {"memory_limit_GB": limit / 1e9, "cgroup_max_usage_GB": usage / 1e9, "oom_kills": ooms,
               "wall_s": time.perf_counter() - started}
    if out.returncode != 0 or not os.path.exists(log):
        lines = out.stderr.strip().splitlines()
        return {**figures, "error": lines[-1] if lines else f"exit {out.returncode}", "exit_code": out.returncode}
    with open(log) as f:
        data = json.load(f)
    steps = data["steps"]
    return {
        **figures,
        "log": log,
        "steps_completed": len(steps),
        "losses": [s["loss"] for s in steps],
        "init_s": data["init_s"],
        "step_s": [s["step_s"] for s in steps],
        "peak_rss_GB": max(data["init_peak_rss_bytes"], *(s["peak_rss_bytes"] for s in steps)) / 1e9,
        "init_peak_rss_GB": data["init_peak_rss_bytes"] / 1e9,
        "nvme_read_GB_per_step": steps[-1].get("read_bytes_nvme", 0) / 1e9,
        "nvme_write_GB_per_step": steps[-1].get("write_bytes_nvme", 0) / 1e9,
        "budget": data.get("budget"),
        "update_parts": data.get("update_parts"),
    }
