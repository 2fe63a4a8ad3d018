"""Checks on the store's filesystem, made before anything is written to it."""

from __future__ import annotations

import errno
import os
import tempfile

from zinfjax.store.errors import StorePathError, StoreSpaceError


def prepare_directory(directory: str) -> None:
    """Creates `directory` if needed and proves it writable; raises `StorePathError` otherwise."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise StorePathError(
            f"cannot create the store directory {directory}: {e.strerror}; choose a writable nvme_path"
        ) from e
    if not os.path.isdir(directory):
        raise StorePathError(f"the store path {directory} is not a directory; choose another nvme_path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise StorePathError(
            f"the store directory {directory} is not writable: {e.strerror}; choose a writable nvme_path"
        ) from e


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged write can still use on the filesystem of `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_free_space(directory: str, needed: int) -> None:
    """Raises `StoreSpaceError` if the filesystem of `directory` has fewer than `needed` bytes free."""
    free = free_bytes(directory)
    if needed > free:
        raise StoreSpaceError(
            f"the store at {directory} needs {needed} bytes but only {free} are free; "
            "free some space or use another nvme_path"
        )


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` (an OSError or a tensorstore error) reports ENOSPC or EDQUOT."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    msg = str(e).lower()
    return "no space left" in msg or "enospc" in msg or "quota exceeded" in msg
