"""malloc on transparent huge pages: the environment ``zinfjax train`` restarts itself with, and that it does."""

import json
import platform
import subprocess
import sys

import pytest

from tests.support import xla_flags
from zinfjax.runtime.allocator import HUGE_PAGES, huge_pages_env, thp_mode


def test_the_tunable_is_added_once_beside_the_users_own():
    env = huge_pages_env({"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "glibc", "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES}"}
    assert huge_pages_env(env, "glibc", "madvise") is None  # already there: no second restart
    assert huge_pages_env({}, "glibc", "always") == {"GLIBC_TUNABLES": HUGE_PAGES}


@pytest.mark.parametrize("environ,libc,mode", [({"ZINFJAX_HUGE_PAGES": "0"}, "glibc", "madvise"),
                                               ({}, "", "madvise"),  # musl, or not Linux
                                               ({}, "glibc", "never"), ({}, "glibc", None)])
def test_nothing_is_added_when_turned_off_or_not_glibc_or_the_kernel_has_no_huge_pages(environ, libc, mode):
    assert huge_pages_env(environ, libc, mode) is None


def test_the_kernel_mode_is_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(str(path)) == "madvise"
    assert thp_mode(str(tmp_path / "missing")) is None


def _train_log(tmp_path, **env) -> dict:
    log = tmp_path / "log.json"
    # One CPU device, as a user's process (the default mesh takes every device; the test process simulates 8).
    child_env = {k: v for k, v in xla_flags.child_env().items() if k != "GLIBC_TUNABLES"} | env
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", "train", "--quiet", "--set", "model=gpt2-tiny",
                          "--set", "steps=1", "--set", f"log={log}"], env=child_env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(log.read_text())


def test_zinfjax_train_runs_on_huge_pages_where_the_machine_has_them_and_not_when_turned_off(tmp_path):
    available = huge_pages_env({}, platform.libc_ver()[0], thp_mode()) is not None
    assert _train_log(tmp_path)["malloc_huge_pages"] is available
    assert _train_log(tmp_path, ZINFJAX_HUGE_PAGES="0")["malloc_huge_pages"] is False


_KEEPS = """
import ctypes, sys
from zinfjax.runtime.allocator import GLIBC_TRIM_THRESHOLD, KEEP_FREE, tune_allocator
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
assert tune_allocator(trim_threshold=KEEP_FREE if sys.argv[1] == "keep" else GLIBC_TRIM_THRESHOLD)

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

blocks = [libc.malloc(16 << 20) for _ in range(8)]  # layer-sized, under the 32 MiB mmap threshold: the heap
for b in blocks:
    ctypes.memset(b, 1, 16 << 20)
full = rss()
for b in reversed(blocks):
    libc.free(b)
print(full - rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the trim threshold is glibc's")
def test_the_heap_keeps_freed_layers_for_the_next_unless_memory_is_capped():
    """128 MiB of layers freed at the heap's top: kept (KEEP_FREE), or given back as a capped run wants."""
    def released(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _KEEPS, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout)

    assert released("keep") < 16 << 20
    assert released("capped") > 120 << 20
