"""The XLA flags the test processes compile with, for the test process and the processes the tests start.

Tests compile hundreds of small functions and run each a few times, so XLA's backend optimisations cost
more than they save here (tests/conftest.py); both sides of every comparison are compiled alike. A child
process of a test that checks what a run does (it ends, its loss is finite, it equals another run) compiles
with the same flags: a process that measures (memory, speed) and the benchmarks keep XLA's defaults.
This module imports nothing, so conftest.py can read it before JAX starts.
"""

from __future__ import annotations

import os

# XLA's older CPU fusion emitters compile a test's small functions in about half the time of the newer ones
# (an engine test's 89 compiles: 10.2 s -> 5.0 s; the short suite 18:54 -> 16:14 on 2 cores). The flag is known to
# the jaxlib releases checked here: XLA aborts on a flag it does not know, so another release goes without it.
LEGACY_EMITTERS_RELEASES = ("0.10.",)


def _jaxlib_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxlib")
    except PackageNotFoundError:
        return ""


def fast_compile_flags(jaxlib: str) -> str:
    """The fast-compile XLA flags for the given jaxlib release.

    >>> fast_compile_flags("0.10.2").split()[-1]
    '--xla_cpu_use_fusion_emitters=false'
    >>> fast_compile_flags("0.11.0")
    '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
    """
    flags = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    if jaxlib.startswith(LEGACY_EMITTERS_RELEASES):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    return " ".join(flags)


FAST_COMPILE = fast_compile_flags(_jaxlib_version())


def child_env(devices: int | None = None, environ=None) -> dict[str, str]:
    """``environ`` (default: this process's) for a child that checks behaviour: XLA_FLAGS are the fast-compile
    flags, with ``devices`` simulated CPU devices if given (else one, as a user's process has), and the kernel
    path's cap where the parent has one (`make test-portable`), so a child computes as its test does.

    >>> flags = child_env(2, {"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2 --xla_force_host_platform_device_count=8"})
    >>> flags["XLA_FLAGS"] == FAST_COMPILE + " --xla_cpu_max_isa=SSE4_2 --xla_force_host_platform_device_count=2"
    True
    """
    env = dict(os.environ if environ is None else environ)
    cap = [f for f in env.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa=")]
    count = [f"--xla_force_host_platform_device_count={devices}"] if devices else []
    env["XLA_FLAGS"] = " ".join([FAST_COMPILE, *cap, *count])
    return env
