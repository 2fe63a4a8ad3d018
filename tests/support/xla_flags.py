"""The XLA flags the test processes compile with, for the test process and the processes the tests start.

Tests compile hundreds of small functions and run each a few times, so XLA's backend optimisations cost
more than they save here (tests/conftest.py); both sides of every comparison are compiled alike. A child
process of a test that checks what a run does (it ends, its loss is finite, it equals another run) compiles
with the same flags: a process that measures (memory, speed) and the benchmarks keep XLA's defaults.
This module imports nothing, so conftest.py can read it before JAX starts.
"""

from __future__ import annotations

import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def child_env(devices: int | None = None, environ=None) -> dict[str, str]:
    """``environ`` (default: this process's) for a child that checks behaviour: XLA_FLAGS are the fast-compile
    flags, with ``devices`` simulated CPU devices if given (else one, as a user's process has), and the kernel
    path's cap where the parent has one (`make test-portable`), so a child computes as its test does.

    >>> child_env(2, {"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2 --xla_force_host_platform_device_count=8"})["XLA_FLAGS"]
    '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_max_isa=SSE4_2 \
--xla_force_host_platform_device_count=2'
    """
    env = dict(os.environ if environ is None else environ)
    cap = [f for f in env.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa=")]
    count = [f"--xla_force_host_platform_device_count={devices}"] if devices else []
    env["XLA_FLAGS"] = " ".join([FAST_COMPILE, *cap, *count])
    return env
