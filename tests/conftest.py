"""Test setup: 8 simulated CPU devices and loud numerics, before JAX starts."""

import importlib.abc
import importlib.util
import os
import sys

from tests.support.xla_flags import FAST_COMPILE

# 8 simulated CPU devices. Tests compile hundreds of small functions and run each a few times, so XLA's
# backend optimisations cost more than they save here (test_engine_stages.py: 244 s -> 143 s); both sides of
# every comparison are compiled alike. Benchmarks, users, and the test children that measure keep XLA's
# defaults; children that check behaviour compile as the tests do (tests.support.xla_flags.child_env).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + FAST_COMPILE
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, test processes and their subprocesses alike: the
# same stage functions are compiled by many tests, and a compile costs more than most steps on 2 cores.
# Every compile is kept, however short: a step compiles hundreds of small functions, each under 0.05 s, and
# their sum is most of a test's time (tests/engine/test_host_update.py, test_step_overhead.py and
# models/test_products.py on a warm cache: 105 s keeping compiles over 0.05 s, 68 s keeping all; cold: 141 s).
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

# The tests test this checkout: its interop/ is zinfjax_interop, whatever an install elsewhere maps that name to
# (an editable install of another checkout of the repository, whose zinfjax this checkout's tests put second on
# sys.path, would otherwise give them that checkout's interop/).
_INTEROP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "interop")


class _CheckoutInterop(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "zinfjax_interop":
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(_INTEROP, "__init__.py"),
                                                      submodule_search_locations=[_INTEROP])


if "zinfjax_interop" not in sys.modules:
    sys.meta_path.insert(0, _CheckoutInterop())

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_platforms", "cpu")

# Hypothesis draws the same examples on every run, so CI passes or fails on the code alone, never on the
# draw (a random draw once found a damaged checkpoint that exhausted memory, and took a CI run down with it).
# HYPOTHESIS_PROFILE=explore draws anew each run: `make fuzz`.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """A low-precision test is a numeric one too: `make test-portable` runs every numeric test (pyproject.toml)."""
    import pytest

    for item in items:
        if item.get_closest_marker("low_precision"):
            item.add_marker(pytest.mark.numeric)
