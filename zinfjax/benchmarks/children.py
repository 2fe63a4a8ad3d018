"""The environment of a benchmark's child process: one CPU device, as a user's process has.

The parent may simulate several CPU devices (``--xla_force_host_platform_device_count``, as the tests
do); a user's ``zinfjax train`` sees one. Every other XLA flag the parent runs with is kept, so that a
child compiles as its parent asked (a user's flags, the tests' fast-compile flags).

Example:
    >>> one_device_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=SSE4_2"})
    {'XLA_FLAGS': '--xla_cpu_max_isa=SSE4_2'}
    >>> one_device_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "HOME": "/root"})
    {'HOME': '/root'}
"""

from __future__ import annotations

import os
from collections.abc import Mapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="


def one_device_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without the flag that simulates several CPU devices."""
    env = dict(os.environ if environ is None else environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env
