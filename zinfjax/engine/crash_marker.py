"""A marker of the step in progress, so that a process killed mid-step is noticed at the next start.

The nvme working state is overwritten in place during a step (zinfjax/engine/stores.py), so a
process killed mid-step leaves it neither the old step nor the new one. The engine writes
``<nvme_path>/STEP_IN_PROGRESS`` when a step starts and removes it when the step's writes have
landed; the next engine on that path finds it, reports the step (`Engine.interrupted_step`),
and rebuilds the working state from its source: a checkpoint, or the initial parameters. Each function
takes the run's ``nvme_path``, or None for a run with no state on NVMe (no marker).

Example (what a killed process leaves, and what the next engine on its nvme_path reads; its
`Engine.interrupted_step`):
    >>> import tempfile
    >>> nvme_path = tempfile.mkdtemp()
    >>> begin(nvme_path, 7)                 # step 7 starts, and the process is killed before end(nvme_path)
    >>> interrupted(nvme_path)
    7
    >>> end(nvme_path); interrupted(nvme_path) is None
    True
"""

from __future__ import annotations

import json
import os

MARKER = "STEP_IN_PROGRESS"


def _path(nvme_path: str | None) -> str | None:
    return os.path.join(nvme_path, MARKER) if nvme_path else None


def interrupted(nvme_path: str | None) -> int | None:
    """The step a previous process left in progress on ``nvme_path`` (None: a run with no state on NVMe), if any."""
    path = _path(nvme_path)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError):
        return -1  # the marker itself was cut short


def begin(nvme_path: str | None, step: int) -> None:
    path = _path(nvme_path)
    if path is not None:
        with open(path, "w") as f:
            json.dump({"step": step, "pid": os.getpid()}, f)


def end(nvme_path: str | None) -> None:
    path = _path(nvme_path)
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
