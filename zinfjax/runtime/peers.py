"""Watching the other processes of a run: a peer that dies or hangs ends every process with one line.

Whatever started the processes (``zinfjax launch``, SLURM, a Kubernetes job), each one runs a
`Watchdog` once `jax.distributed` is up (`zinfjax.runtime.distributed.initialize_from_env`). Its
daemon thread writes a heartbeat, a counter, to the coordination service's key-value store every
`interval` seconds and reads everyone else's. A peer whose counter has not moved for
``ZINFJAX_PEER_TIMEOUT`` seconds (default 60) is gone: stopped (``SIGSTOP``, a frozen node) or
cut off. The watchdog then prints one line naming it and ends this process with exit code 1,
before XLA's own heartbeat check would abort it with a C++ stack trace (`xla_heartbeat_timeout`).
A second thread judges, so a heartbeat call blocked on a stopped coordinator (process 0) is
noticed too. Both wait in C or sleep without the GIL, so a main thread blocked in a collective on
the missing peer does not hold them up (tests/runtime/test_peer_faults.py). Process 0 publishes
what it found and lingers a few heartbeats before it exits, so that the others say the same
before its exit takes the coordination service from them.

A collective that fails because a peer died (gloo: "Connection closed by peer") is reported the
same way, sooner: `stop_if_peer_lost` names a peer whose heartbeat stopped a few intervals ago.

Not covered: a killed process 0. jaxlib's client then aborts the others at once, with XLA's
message and a stack, and its hook for that moment (``missed_heartbeat_callback``) fails with
``std::bad_cast`` in jaxlib 0.10, so there is no way in from here (docs/sharding.md).

Example (``Watchdog(client, rank, count, timeout).start()`` beats and judges in two threads; here a stand-in for
the coordination service's client, and a clock moved by hand, show one heartbeat round at a time):
    >>> class Service:                              # what the watchdog uses of jax's DistributedRuntimeClient
    ...     kv = {}
    ...     def key_value_set(self, key, value, overwrite): self.kv[key] = value
    ...     def key_value_dir_get(self, prefix): return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]
    >>> service, now = Service(), [0.0]
    >>> dogs = [Watchdog(service, rank=r, count=2, timeout=60.0, clock=lambda: now[0]) for r in (0, 1)]
    >>> for t in (0.0, 30.0):                       # both beat at 0 s and 30 s
    ...     now[0] = t; dogs[1].round(); dogs[0].round()
    >>> for t in (60.0, 100.0, 130.0):              # then process 1 is silent
    ...     now[0] = t; dogs[0].round()
    >>> dogs[0].missing(60.0)
    (1, 100.0)
    >>> print(dogs[0].line(1, 100.0))
    zinfjax: error: process 1 of 2 stopped responding (no heartbeat for 100 s); stopping process 0 (the limit ...)
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable

PEER_TIMEOUT = "ZINFJAX_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 60
PREFIX = "zinfjax/heartbeat/"
LOST = "lost"  # the key under PREFIX where process 0 publishes the peer it found gone
QUICK_BEATS = 3  # after a failed collective, a peer this many heartbeats late is the one that died


def interval(timeout: float) -> float:
    """Seconds between heartbeats: a twentieth of the timeout, between 0.25 s and 2 s.

    Example:
        >>> interval(60), interval(2)
        (2.0, 0.25)
    """
    return max(0.25, min(timeout / 20, 2.0))


def xla_heartbeat_timeout(timeout: float) -> int:
    """XLA's own heartbeat timeout (its abort with a stack trace): well after ours, so that ours reports.

    Example:
        >>> xla_heartbeat_timeout(60)
        150
    """
    return int(2 * timeout + 30)


class Watchdog:
    """Heartbeats of process ``rank`` of ``count`` through ``client`` (a jax DistributedRuntimeClient)."""

    def __init__(self, client, rank: int, count: int, timeout: float,
                 on_lost: Callable[[str, float], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.client, self.rank, self.count, self.timeout = client, rank, count, float(timeout)
        self.interval = interval(self.timeout)
        self.clock = clock
        self.on_lost = on_lost or _print_and_exit
        now = clock()
        self.seen = {p: now for p in range(count) if p != rank}  # when each peer's counter last moved
        self.beats: dict[int, str] = {}
        self.moves = dict.fromkeys(self.seen, 0)  # how often each peer's counter has moved
        self.polled = now  # the last heartbeat round that reached the coordination service
        self.lock = threading.Lock()
        self.beat = 0
        self.verdict: tuple[int, float] | None = None  # (peer, seconds) that process 0 found gone
        self.exiting = False  # set at exit: the peers leave too, and the service goes with process 0

    def start(self) -> Watchdog:
        for target, name in ((self._beat_loop, "beat"), (self._judge_loop, "judge")):
            threading.Thread(target=target, name=f"zinfjax-peers-{name}", daemon=True).start()
        return self

    # ---- the two threads -------------------------------------------------------------------------

    def _beat_loop(self) -> None:
        while True:
            try:
                self.round()
            except Exception as e:  # noqa: BLE001 - the service is gone (process 0 died): it answers nothing
                if self.rank != 0:
                    self.report(0, self.clock() - self.polled, f"its coordination service: {_first(e)}")
                return
            if self.verdict is not None:  # process 0 found a peer gone: say so before process 0 leaves
                self.report(*self.verdict)
            time.sleep(self.interval)

    def _judge_loop(self) -> None:
        while True:
            time.sleep(self.interval)
            lost = self.missing(self.timeout)
            if lost is not None:
                self.report(*lost)
                return

    # ---- one heartbeat, one judgement ------------------------------------------------------------

    def round(self) -> None:
        """Writes this process's next heartbeat and reads everyone's (one call each to the service)."""
        self.beat += 1
        self.client.key_value_set(f"{PREFIX}{self.rank}", str(self.beat), True)
        entries = self.client.key_value_dir_get(PREFIX)
        now = self.clock()
        with self.lock:
            for key, value in entries:
                name = key.rsplit("/", 1)[-1]
                if name == LOST:
                    peer, age = value.split()
                    self.verdict = int(peer), float(age)
                    continue
                peer = int(name)
                if peer in self.seen and self.beats.get(peer) != value:
                    self.beats[peer], self.seen[peer] = value, now
                    self.moves[peer] += 1
            self.polled = now

    def missing(self, limit: float) -> tuple[int, float] | None:
        """``(peer, seconds)`` of a peer silent for over ``limit`` seconds, else None.

        A coordinator (process 0) that stopped answering is silent too: its service holds every heartbeat.
        """
        now = self.clock()
        with self.lock:
            if self.rank != 0 and now - self.polled > limit:
                return 0, now - self.polled
            late = [(now - t, p) for p, t in self.seen.items() if now - t > limit]
        if not late:
            return None
        age, peer = max(late)
        return peer, age

    def lost_after_error(self) -> tuple[int, float] | None:
        """After a failed collective: the peer that stopped beating, waiting a few heartbeats to tell.

        Returns None as soon as every peer's counter has moved twice since the failure (the cause lies
        elsewhere): a dead peer's moves once at most, when its last heartbeat is read after the failure.
        """
        deadline = self.clock() + (QUICK_BEATS + 2) * self.interval  # a beat is seen up to one late
        with self.lock:
            before = dict(self.moves)
        while self.clock() < deadline:
            lost = self.missing(QUICK_BEATS * self.interval)
            if lost is not None:
                return lost
            with self.lock:
                if all(self.moves[p] >= before[p] + 2 for p in before):
                    return None
            time.sleep(self.interval / 4)
        return None

    def report(self, peer: int, age: float, how: str = "") -> None:
        """Ends this process with one line naming ``peer``.

        Process 0 first publishes its verdict and lingers a few heartbeats, so the others read it
        and say the same before its exit takes the coordination service (and XLA's abort) to them.
        """
        if self.exiting:
            return
        linger = 0.0
        if self.rank == 0 and self.count > 2:
            try:
                self.client.key_value_set(f"{PREFIX}{LOST}", f"{peer} {age:.1f}", True)
                linger = 2 * self.interval + 0.5
            except Exception:  # noqa: BLE001 - a service that fails now: the others find out themselves
                pass
        self.on_lost(self.line(peer, age, how), linger)

    def line(self, peer: int, age: float, how: str = "") -> str:
        what = how or f"no heartbeat for {age:.0f} s"
        return (f"zinfjax: error: process {peer} of {self.count} stopped responding ({what}); stopping process "
                f"{self.rank} (the limit is {PEER_TIMEOUT}={self.timeout:g} s)")


_reporting = threading.Lock()  # one line, however many threads find the peer gone


def _print_and_exit(line: str, linger: float = 0.0) -> None:
    _reporting.acquire()  # a second reporter waits here until the first has ended the process
    print(line, file=sys.stderr, flush=True)
    time.sleep(linger)
    _exit_now(1)


def _first(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


_watchdog: Watchdog | None = None
_exit_now: Callable[[int], None] = sys.exit


def watch(client, rank: int, count: int, timeout: float, exit_now: Callable[[int], None]) -> Watchdog:
    """Starts this process's watchdog (once), which ends the process with ``exit_now(1)``; `stop_if_peer_lost`
    consults it."""
    global _watchdog, _exit_now
    _exit_now = exit_now
    if _watchdog is None:
        _watchdog = Watchdog(client, rank, count, timeout).start()
        atexit.register(setattr, _watchdog, "exiting", True)  # runs before jax's own shutdown (registered earlier)
    return _watchdog


def stop_if_peer_lost() -> None:
    """After an error in a multi-process run: when a peer has died, say so in one line and exit 1.

    It returns (the caller reports the error itself) when no watchdog runs or every peer is alive.
    """
    if _watchdog is None:
        return
    lost = _watchdog.lost_after_error()
    if lost is not None:
        _watchdog.report(*lost)
