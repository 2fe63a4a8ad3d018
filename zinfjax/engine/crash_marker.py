"""A marker of the step in progress, so that a process killed mid-step is noticed at the next start.

The nvme working state is overwritten in place during a step (zinfjax/engine/stores.py), so a
process killed mid-step leaves it neither the old step nor the new one. The engine writes
``<nvme_path>/STEP_IN_PROGRESS`` when a step starts and removes it when the step's writes have
landed; the next engine on that path finds it, reports the step (`Engine.interrupted_step`),
and rebuilds the working state from its source: a checkpoint, or the initial parameters.

Example (what a killed process leaves, and what the next engine on its nvme_path reads; its
`Engine.interrupted_step`):
    >>> import tempfile
    >>> from zinfjax import Config
    >>> config = Config(params="nvme", nvme_path=tempfile.mkdtemp())
    >>> begin(config, 7)                    # step 7 starts, and the process is killed before end(config)
    >>> interrupted(config)
    7
    >>> end(config); interrupted(config) is None
    True
"""

from __future__ import annotations

import json
import os

MARKER = "STEP_IN_PROGRESS"


def _path(config) -> str | None:
    return os.path.join(config.nvme_path, MARKER) if config.uses_nvme and config.nvme_path else None


def interrupted(config) -> int | None:
    """The step a previous process left in progress on this nvme_path, if any."""
    path = _path(config)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return -1  # the marker itself was cut short


def begin(config, step: int) -> None:
    path = _path(config)
    if path is not None:
        with open(path, "w") as f:
            json.dump({"step": step, "pid": os.getpid()}, f)


def end(config) -> None:
    path = _path(config)
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
