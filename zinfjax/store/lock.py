"""A lock file that keeps two processes off one store directory.

The lock is `<store>/.lock`, created with O_CREAT|O_EXCL and holding the owner's pid and
hostname. A lock left by a dead process on this host is stale and is taken over; a live owner,
or an owner on another host (whose liveness we cannot check), is an error naming it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from zinfjax.store.errors import StoreLockedError

LOCK = ".lock"
_HALF_WRITTEN_GRACE_S = 10.0
log = logging.getLogger(__name__)


class StoreLock:
    """An exclusive, process-level lock on a store directory.

    Example:
        >>> import tempfile
        >>> directory = tempfile.mkdtemp()
        >>> lock = StoreLock(directory)
        >>> lock.acquire()
        >>> StoreLock(directory).acquire()         # held: by this process here, by another one in a real run
        Traceback (most recent call last):
        zinfjax.store.errors.StoreLockedError: the store ... is locked by process ... (lock file .../.lock); ...
        >>> lock.release()
        >>> again = StoreLock(directory); again.acquire(); again.release()   # free again
    """

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK)
        self.held = False

    def acquire(self) -> None:
        """Takes the lock, reclaiming a stale one; raises `StoreLockedError` if it is held."""
        for _ in range(3):
            if self._try_create():
                self.held = True
                return
            owner = self._owner()
            if owner is not None and not _is_stale(owner):
                raise StoreLockedError(
                    f"the store {os.path.dirname(self.path)} is locked by process {owner.get('pid')} on "
                    f"host {owner.get('hostname')} (lock file {self.path}); stop that process, use another "
                    "nvme_path, or delete the lock file if that process is gone"
                )
            log.info("reclaiming stale store lock %s left by %s", self.path, owner)
            _remove(self.path)
        raise StoreLockedError(f"could not take the store lock {self.path}; another process keeps taking it")

    def release(self) -> None:
        """Drops the lock if this object holds it."""
        if self.held:
            _remove(self.path)
            self.held = False

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "hostname": socket.gethostname()}, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            # Half-written: its writer is between create and write, or died there. Only the
            # second case lasts, so an old half-written lock is stale.
            if time.time() - _mtime(self.path) > _HALF_WRITTEN_GRACE_S:
                return None
            return {"pid": "unknown (lock being written)", "hostname": socket.gethostname()}


def _is_stale(owner: dict) -> bool:
    if not owner:
        return True
    if owner.get("hostname") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    return not pid_alive(owner["pid"])


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
