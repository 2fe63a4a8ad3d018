"""Joining a multi-process run: `jax.distributed` from environment variables, with gloo on CPU.

`zinfjax launch` sets these variables for every process it starts (docs/sharding.md):

- ``ZINFJAX_COORDINATOR``: ``host:port`` of process 0's coordination service;
- ``ZINFJAX_NUM_PROCESSES``: how many processes take part;
- ``ZINFJAX_PROCESS_ID``: this process's rank, ``0 .. N-1``;
- ``ZINFJAX_LOCAL_DEVICES`` (optional): how many CPU devices this process simulates;
- ``ZINFJAX_CONNECT_TIMEOUT`` (optional): seconds to wait for every peer to connect, and at exit
  for every peer to finish (default 60);
- ``ZINFJAX_PEER_TIMEOUT`` (optional): seconds without a heartbeat after which a peer counts as
  dead or hung, and every other process stops with one line naming it (default 60;
  `zinfjax.runtime.peers`).

Any launcher may set them (SLURM, a Kubernetes job; docs/sharding.md, "Other launchers").

Example (a single process: the variables are unset):
    >>> initialize_from_env()       # before any JAX computation
    False
    >>> process_nvme_path("/mnt/nvme/run1")
    '/mnt/nvme/run1'
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping

import jax

from zinfjax.errors import UserError
from zinfjax.runtime import peers

COORDINATOR = "ZINFJAX_COORDINATOR"
NUM_PROCESSES = "ZINFJAX_NUM_PROCESSES"
PROCESS_ID = "ZINFJAX_PROCESS_ID"
LOCAL_DEVICES = "ZINFJAX_LOCAL_DEVICES"
CONNECT_TIMEOUT = "ZINFJAX_CONNECT_TIMEOUT"
PEER_TIMEOUT = peers.PEER_TIMEOUT
FAILURES = "ZINFJAX_FAILURES"  # set by `zinfjax launch`: where a failing process records when it failed
DEFAULT_CONNECT_TIMEOUT = 60
XLA_CONNECT_MARGIN_S = 30  # XLA's own deadline, later than ours so that ours reports


class DistributedError(UserError):
    """A multi-process run that cannot start: bad variables, or a peer that never connected."""


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Joins the run the ``ZINFJAX_*`` variables describe; returns whether it is multi-process.

    Call it before any JAX computation. It selects gloo for CPU collectives, sets the number of
    simulated CPU devices when ``ZINFJAX_LOCAL_DEVICES`` is given, and calls
    `jax.distributed.initialize`. Without ``ZINFJAX_NUM_PROCESSES`` it does nothing; a second
    call is a no-op.

    Example (``ZINFJAX_COORDINATOR=127.0.0.1:8476 ZINFJAX_NUM_PROCESSES=2 ZINFJAX_PROCESS_ID=1 python train.py``
    joins a run of two and returns True; `zinfjax.runtime.launch` sets them):
        >>> initialize_from_env({})                          # none set: a single process
        False
        >>> initialize_from_env({"ZINFJAX_NUM_PROCESSES": "two"})
        Traceback (most recent call last):
        zinfjax.runtime.distributed.DistributedError: ZINFJAX_NUM_PROCESSES='two' must be an integer >= 1
    """
    env = with_torchrun_names(os.environ if environ is None else environ)
    if NUM_PROCESSES not in env:
        return False
    if jax.distributed.is_initialized():
        return True
    count, rank = _int(env, NUM_PROCESSES, 1), _int(env, PROCESS_ID, 0)
    address = env.get(COORDINATOR, "")
    if rank >= count or ":" not in address:
        raise DistributedError(f"{PROCESS_ID}={rank} must be below {NUM_PROCESSES}={count}, and "
                               f"{COORDINATOR}={address!r} must be host:port; start processes with `zinfjax launch`")
    timeout = _int(env, CONNECT_TIMEOUT, 1) if CONNECT_TIMEOUT in env else DEFAULT_CONNECT_TIMEOUT
    peer_timeout = _int(env, PEER_TIMEOUT, 1) if PEER_TIMEOUT in env else peers.DEFAULT_PEER_TIMEOUT
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service would catch SIGTERM and keep running; the launcher's SIGTERM means stop.
    jax.config.update("jax_enable_preemption_service", False)
    if LOCAL_DEVICES in env:
        jax.config.update("jax_num_cpu_devices", _int(env, LOCAL_DEVICES, 1))
    _connect(address, count, rank, timeout, peer_timeout)
    from jax._src import distributed  # JAX's private module: its client reaches the key-value store

    peers.watch(distributed.global_state.client, rank, count, peer_timeout, exit_now)
    _fail_fast_on_uncaught_errors()
    return True


TORCHRUN = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def with_torchrun_names(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with the ``ZINFJAX_*`` variables taken from torchrun's, when only those are set.

    So a job started by ``torchrun`` or a cluster script that exports torch's variables joins
    without a wrapper.

    Example:
        >>> with_torchrun_names({"WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"})[
        ...     "ZINFJAX_COORDINATOR"]
        'n0:29500'
    """
    if NUM_PROCESSES in env or not all(k in env for k in TORCHRUN):
        return env
    return {**env, NUM_PROCESSES: env["WORLD_SIZE"], PROCESS_ID: env["RANK"],
            COORDINATOR: f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"}


def _connect(address: str, count: int, rank: int, timeout: int, peer_timeout: int) -> None:
    """`jax.distributed.initialize`, with a clear one-line error if the peers do not all join in time.

    XLA aborts the process when its own connect deadline passes, with a C++ stack trace; a
    watchdog that fires first says instead what went wrong.
    """

    def give_up():
        print(f"zinfjax: error: process {rank} of {count}: not all {count} processes joined the run at "
              f"{address} within {timeout} s; start every rank (`zinfjax launch -n {count}` does) or raise "
              f"{CONNECT_TIMEOUT}", file=sys.stderr, flush=True)
        exit_now(2)

    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        # The shutdown barrier at exit waits for the peers too; a peer that never arrives (it called
        # sys.exit while the others compute) then ends the run after `timeout` instead of hanging it.
        # XLA's heartbeat check aborts with a stack trace; it is set well after our watchdog's (peers.py).
        jax.distributed.initialize(address, count, rank, initialization_timeout=timeout + XLA_CONNECT_MARGIN_S,
                                   shutdown_timeout_seconds=timeout,
                                   heartbeat_timeout_seconds=peers.xla_heartbeat_timeout(peer_timeout))
    except Exception as e:  # noqa: BLE001 - XLA raises several types; all mean the same to the user
        raise DistributedError(f"process {rank} of {count} could not join the run at {address}: "
                               f"{type(e).__name__}: {_first_line(e)}") from e
    finally:
        watchdog.cancel()


def _fail_fast_on_uncaught_errors() -> None:
    """An uncaught exception ends this process at once, skipping the shutdown barrier.

    Otherwise the failed process would wait at exit for peers that wait for it in a collective,
    and the launcher could not tell which rank failed first.
    """
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, Exception):
            peers.stop_if_peer_lost()  # a collective that failed because a peer died: one line naming it
        record_failure()
        previous(kind, value, tb)
        exit_now(1)

    sys.excepthook = hook


def record_failure() -> None:
    """Notes the time this process failed, for `zinfjax launch` to name the rank that failed first.

    A process writes it before it exits, so before its peers can notice it has gone: the earliest
    record is the cause, whatever order the exits reach the launcher in.
    """
    directory = os.environ.get(FAILURES)
    if directory:
        try:
            with open(os.path.join(directory, os.environ.get(PROCESS_ID, "0")), "x") as f:  # the first time counts
                f.write(str(time.monotonic_ns()))
        except OSError:
            pass


def exit_now(code: int) -> None:
    """Flushes output and ends this process with ``code`` at once: no atexit, no shutdown barrier.

    The way out of a failed multi-process run, whose peers may be blocked in a collective.

    Example (it ends the interpreter that runs it, so it is not run here):
        >>> exit_now(2)    # doctest: +SKIP
    """
    if code:
        record_failure()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise DistributedError(f"{name}={raw!r} must be an integer >= {minimum}")
    return value


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


def is_main_process() -> bool:
    """Whether this process writes logs and shows progress: process 0, or a single process.

    Example:
        >>> is_main_process()
        True
    """
    return jax.process_index() == 0


def process_nvme_path(nvme_path: str | None) -> str | None:
    """This process's own NVMe directory: ``nvme_path/process_<i>`` when several processes run.

    Example (a single process keeps it; process 1 of 2 gets ``/mnt/nvme/run1/process_1``):
        >>> process_nvme_path("/mnt/nvme/run1")
        '/mnt/nvme/run1'
    """
    if nvme_path is None or jax.process_count() == 1:
        return nvme_path
    return os.path.join(nvme_path, f"process_{jax.process_index()}")


def barrier(name: str, timeout_s: float = 600.0) -> None:
    """Waits until every process reaches barrier ``name``; a no-op in a single-process run.

    It goes through the coordination service's key-value store, not a device collective, so a
    background thread (an asynchronous checkpoint) may call it while training runs.

    Example:
        >>> barrier("checkpoint-100")
    """
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # lazy: JAX's private module, reached only with several processes

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
