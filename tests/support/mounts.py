"""A real tmpfs mounted by a test (disk-full, read-only), skipped with the reason where mounting is not allowed."""

from __future__ import annotations

import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def tmpfs(path, size: str, read_only: bool = False):
    """Mounts a tmpfs of ``size`` at ``path`` for the duration of the block."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or 'mount failed'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
