"""This process's resident memory: now, at its peak, and the peak since a reset (Linux ``/proc``).

``zinfjax train`` resets the peak before each step and reads it after, so its JSON log records
each step's own peak (``peak_rss_bytes``), and the peak of initialisation before the first step.

Example:
    >>> import mmap
    >>> reset_peak()
    True
    >>> before = current_bytes()
    >>> with mmap.mmap(-1, 64 << 20) as step:       # one training step, which holds 64 MiB a while
    ...     _ = step.write(bytes(64 << 20))
    >>> peak_bytes() - before > 48 << 20            # the most this process held during that step: about 64 MiB more
    True
"""

from __future__ import annotations


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def current_bytes() -> int:
    """Resident memory now (VmRSS)."""
    return _status("VmRSS")


def peak_bytes() -> int:
    """Peak resident memory since the process started, or since the last `reset_peak` (VmHWM).

    Not ``getrusage``'s ru_maxrss: Linux keeps across ``exec`` the peak of the image the process
    replaced, which for a child forked from a large parent is the parent's size.
    """
    return _status("VmHWM")


def reset_peak() -> bool:
    """Starts a new peak from the current resident memory; whether the kernel allowed it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
