"""A benchmark child measured from inside: peak RSS, seconds since the process started.

``python -m zinfjax.benchmarks.process REPORT [--import MOD]... MODULE [ARGS...]`` runs MODULE as
``python -m MODULE ARGS...`` would (`runpy`, ``__main__``, ``sys.argv``) and, when it ends, writes
to REPORT (JSON) its exit status, its peak RSS (VmHWM) and the seconds from the process's start to
the end of the ``--import``s: the modules MODULE would import first (for ``zinfjax.cli train``,
``zinfjax.training.loop``), so that start-up is counted apart from what MODULE itself measures.

This module imports nothing heavy: what it adds to the child's peak RSS is the interpreter's own.

Example:
    $ python -m zinfjax.benchmarks.process /tmp/r.json --import zinfjax.training.loop zinfjax.cli train --set steps=2
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM).

    Not ``getrusage``'s ru_maxrss: Linux keeps across ``exec`` the peak of the image the process
    replaced, which for a child forked from a large parent is the parent's size.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def seconds_since_start() -> float:
    """Seconds since this process started (its ``exec``), from /proc (10 ms resolution).

    Example:
        >>> 0 <= seconds_since_start() < 3600
        True
    """
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started


def run_module(report: str, imports: list[str], module: str, args: list[str]) -> None:
    """Runs ``module`` as ``python -m`` does; writes the report even when it raises or exits."""
    for name in imports:
        importlib.import_module(name)
    out = {"imports": imports, "startup_s": seconds_since_start(), "exit": 1}
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        out["exit"] = 0
    except SystemExit as e:
        out["exit"] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        out["peak_rss_bytes"] = peak_rss_bytes()
        with open(report, "w") as f:
            json.dump(out, f)


def main(argv: list[str] | None = None) -> None:
    """``REPORT [--import MOD]... MODULE [ARGS...]``: see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        raise SystemExit("usage: python -m zinfjax.benchmarks.process REPORT [--import MOD]... MODULE [ARGS...]")
    report, rest, imports = argv[0], argv[1:], []
    while len(rest) >= 2 and rest[0] == "--import":
        imports.append(rest[1])
        rest = rest[2:]
    if not rest:
        raise SystemExit("zinfjax.benchmarks.process: no MODULE to run")
    run_module(report, imports, rest[0], rest[1:])


if __name__ == "__main__":
    main()
