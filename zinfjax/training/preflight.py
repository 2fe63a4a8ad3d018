"""Checks that a run makes before it trains, so that a mistake costs seconds, not the whole run.

Example:
    >>> import tempfile
    >>> runs = tempfile.mkdtemp()
    >>> check_writable_file(f"{runs}/demo.json", "log")   # can be written: nothing to say
    >>> check_writable_file(runs, "log")                  # a directory, or read-only: ConfigError now, not at the end
    Traceback (most recent call last):
    zinfjax.errors.ConfigError: log=... is a directory; ...
"""

from __future__ import annotations

import os

from zinfjax.errors import ConfigError


def check_writable_file(path: str, key: str) -> None:
    """Refuses a file path (the value of config ``key``) that is a directory or cannot be written.

    Nothing is left behind: a file created to try is removed, and an existing one is not changed.
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise ConfigError(f"{key}={path} is a directory; give a file path, e.g. {key}={os.path.join(path, 'run.json')}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        existed = os.path.exists(path)
        with open(path, "a"):  # append mode: an existing file keeps its bytes
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ConfigError(f"{key}={path} cannot be written ({e.strerror or e}); choose a writable path") from e
