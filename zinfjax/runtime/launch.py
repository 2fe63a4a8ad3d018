"""``zinfjax launch``: N copies of a command on this machine, joined by `jax.distributed`.

Each copy gets the ``ZINFJAX_*`` variables that `zinfjax.runtime.distributed.initialize_from_env`
reads and, on a host with GPUs, its own equal share of them in ``CUDA_VISIBLE_DEVICES``. Its
output is streamed with a ``[rank i]`` prefix. When any copy fails (a non-zero exit, or killed
by a signal) the others are stopped at once, so a run never hangs on a dead peer, and the
launch reports which rank failed and how. Several hosts: docs/engine.md, "Several processes".

Example (``zinfjax launch -n 2 -- zinfjax train run.yaml`` on the command line; here, a command that says what
it was given):
    >>> said = "import os; rank = os.environ['ZINFJAX_PROCESS_ID']; rank == '1' and print(rank, 'of 2')"
    >>> launch([sys.executable, "-c", said], num_processes=2)
    [rank 1] 1 of 2
    0
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from zinfjax.errors import UserError
from zinfjax.runtime import distributed

POLL_S = 0.05
STOP_GRACE_S = 5.0


class LaunchError(UserError):
    """A launched process failed; ``exit_code`` is what ``zinfjax launch`` exits with."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now.

    Example:
        >>> 1024 <= free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(rank: int, num_processes: int, coordinator: str, devices_per_process: int | None = None,
                connect_timeout: int = distributed.DEFAULT_CONNECT_TIMEOUT, base: dict | None = None) -> dict:
    """The environment of process ``rank``: ``base`` (default: ours) plus the ``ZINFJAX_*`` variables.

    Example:
        >>> process_env(1, 2, "127.0.0.1:8476")["ZINFJAX_PROCESS_ID"]
        '1'
    """
    env = dict(os.environ if base is None else base)
    env.update({
        distributed.COORDINATOR: coordinator,
        distributed.NUM_PROCESSES: str(num_processes),
        distributed.PROCESS_ID: str(rank),
        distributed.CONNECT_TIMEOUT: str(connect_timeout),
        "PYTHONUNBUFFERED": "1",  # so output streams as it happens
    })
    if devices_per_process is not None:
        env[distributed.LOCAL_DEVICES] = str(devices_per_process)
    gpus = host_gpus(env)
    if gpus:
        env[VISIBLE_GPUS] = ",".join(gpus_of_rank(rank, num_processes, gpus))
    return env


VISIBLE_GPUS = "CUDA_VISIBLE_DEVICES"


def host_gpus(env: dict) -> list[str]:
    """The GPUs this host offers: ``CUDA_VISIBLE_DEVICES`` when set, else the NVIDIA driver's list (none on CPU).

    Example:
        >>> host_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
        ['0', '1', '2', '3']
    """
    if VISIBLE_GPUS in env:
        return [g.strip() for g in env[VISIBLE_GPUS].split(",") if g.strip() and g.strip() != "-1"]
    driver = "/proc/driver/nvidia/gpus"
    return [str(i) for i in range(len(os.listdir(driver)))] if os.path.isdir(driver) else []


def gpus_of_rank(rank: int, num_processes: int, gpus: list[str]) -> list[str]:
    """Rank ``rank``'s own share of ``gpus``: an equal, contiguous slice, so no two ranks share a GPU.

    Example:
        >>> gpus_of_rank(1, 2, ["0", "1", "2", "3"])
        ['2', '3']
    """
    if len(gpus) % num_processes:
        raise UserError(f"-n {num_processes} processes cannot share the {len(gpus)} GPUs of this host "
                        f"({VISIBLE_GPUS}={','.join(gpus)}) equally; launch a divisor of {len(gpus)} processes, "
                        f"or set {VISIBLE_GPUS} to a multiple of {num_processes} GPUs")
    share = len(gpus) // num_processes
    return gpus[rank * share : (rank + 1) * share]


def launch(command: Sequence[str], num_processes: int, port: int | None = None,
           devices_per_process: int | None = None,
           connect_timeout: int = distributed.DEFAULT_CONNECT_TIMEOUT) -> int:
    """Runs ``num_processes`` copies of ``command``; returns 0 when all succeed.

    Raises:
        LaunchError: a process failed; the others have been stopped.

    Example (a process that fails):
        >>> fails = "import os; exit(int(os.environ['ZINFJAX_PROCESS_ID']) * 3)"     # process 1: exit code 3
        >>> launch([sys.executable, "-c", fails], num_processes=2)
        Traceback (most recent call last):
        zinfjax.runtime.launch.LaunchError: process 1 of 2 failed with exit code 3; stopped the others (its output ...
    """
    if num_processes < 1:
        raise UserError(f"-n {num_processes}: launch at least one process")
    if not command:
        raise UserError("no command to launch; write it after --, e.g. zinfjax launch -n 2 -- zinfjax train")
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    restore = _interrupt_on_sigterm()
    failures = tempfile.TemporaryDirectory(prefix="zinfjax-launch-")
    try:
        for rank in range(num_processes):
            env = process_env(rank, num_processes, coordinator, devices_per_process, connect_timeout)
            env[distributed.FAILURES] = failures.name
            procs.append(_start(command, env))
            pumps.append(_pump(procs[-1], f"[rank {rank}] "))
        failed = _first_failure(_wait_all(procs), procs, failures.name)
    except BaseException:
        _stop(procs)
        raise
    finally:
        restore()
        failures.cleanup()
    if failed is not None:
        _stop(procs)
    for t in pumps:
        t.join(timeout=STOP_GRACE_S)
    if failed is not None:
        rank, code = failed
        raise LaunchError(f"process {rank} of {num_processes} {_describe(code)}; stopped the others "
                          f"(its output is above, prefixed [rank {rank}])", exit_code=_exit_code(code))
    return 0


def _start(command: Sequence[str], env: dict) -> subprocess.Popen:
    try:
        # A session of its own, so stopping it reaches its children too.
        return subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent())
    except OSError as e:
        raise UserError(f"cannot start {command[0]!r}: {e.strerror}") from e


def _die_with_parent():
    """A pre-exec hook that has the child killed if the launcher dies, even by SIGKILL (Linux only).

    libc is resolved here, in the parent: the hook runs between fork and exec, where importing
    or loading anything could deadlock on a lock another thread held at the fork.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl, pr_set_pdeathsig = ctypes.CDLL(None).prctl, 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGKILL)


def _interrupt_on_sigterm():
    """Makes SIGTERM to the launcher stop its processes as Ctrl-C does; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, old)


def _pump(proc: subprocess.Popen, prefix: str) -> threading.Thread:
    """Copies ``proc``'s output to ours, each line (or progress-bar redraw) prefixed."""

    def copy():
        pending = b""
        while chunk := os.read(proc.stdout.fileno(), 65536):
            pending += chunk
            while (cut := _line_end(pending)) >= 0:
                _emit(prefix.encode() + pending[: cut + 1])
                pending = pending[cut + 1:]
        if pending:
            _emit(prefix.encode() + pending + b"\n")
        proc.stdout.close()

    thread = threading.Thread(target=copy, name=f"zinf-launch-{prefix.strip()}", daemon=True)
    thread.start()
    return thread


def _line_end(data: bytes) -> int:
    ends = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
    return min(ends) if ends else -1


_emit_lock = threading.Lock()


def _emit(data: bytes) -> None:
    with _emit_lock:
        out = getattr(sys.stdout, "buffer", None)  # a text stream without one (a notebook's, doctest's): decoded
        if out is not None:
            out.write(data)
        else:
            sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()


def _wait_all(procs: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Waits until every process has succeeded, or one has failed: then ``(rank, returncode)``.

    One waiter thread per process reports exits in the order they happen, so the rank that
    failed first is named, not a peer that died of losing it a moment later.
    """
    exits: queue.Queue = queue.Queue()
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r=rank, p=p: exits.put((r, p.wait())), daemon=True,
                         name=f"zinf-launch-wait-{rank}").start()
    for _ in procs:
        rank, code = _get(exits)
        if code != 0:
            return rank, code
    return None


def _first_failure(failed: tuple[int, int] | None, procs: list[subprocess.Popen], records: str):
    """The rank that failed first: the earliest failure a process recorded before exiting
    (`distributed.record_failure`), else the first failed exit to reach us (also when that one was
    killed by a signal, which leaves no record)."""
    if failed is None:
        return None
    times = {}
    for name in os.listdir(records):
        try:
            with open(os.path.join(records, name)) as f:
                times[int(name)] = int(f.read())
        except (OSError, ValueError):
            continue
    if not times or (failed[1] < 0 and failed[0] not in times):  # killed by a signal: it could record nothing
        return failed
    rank = min(times, key=times.get)
    try:
        return rank, procs[rank].wait(timeout=STOP_GRACE_S)  # it exits right after writing its record
    except subprocess.TimeoutExpired:
        return rank, failed[1]


def _get(q: queue.Queue):
    # A plain get() would block signals (Ctrl-C, SIGTERM) until an item arrives.
    while True:
        try:
            return q.get(timeout=POLL_S * 10)
        except queue.Empty:
            continue


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every process group still running, then SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        running = [p for p in procs if p.poll() is None]
        for p in running:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            time.sleep(POLL_S)


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"failed with exit code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code
