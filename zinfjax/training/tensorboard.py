"""The per-step metrics of ``zinfjax train`` as TensorBoard scalars (``tensorboard_dir``), written by tensorboardX.

Process 0 alone writes, one event file per run under ``tensorboard_dir``; each step's scalars are at that
step: ``train/loss``, ``train/lr``, ``train/tokens_per_s``; ``time/step_s``, ``time/stall_s``,
``time/compute_s``, ``time/overlap``, ``time/io_floor_s``, ``time/floor_ratio`` (or ``time/io_ratio``);
``bytes/read_<tier>`` and
``bytes/write_<tier>`` (the bytes the step moved from and to each tier), where the step has them.

Example:
    >>> import tempfile
    >>> tb = tempfile.mkdtemp()
    >>> board = Board(tb)
    >>> board.write({"step": 1, "loss": 2.3, "lr": 3e-4, "tokens_per_s": 900.0})
    >>> board.close()
    >>> [name.startswith("events.out.tfevents.") for name in os.listdir(tb)]
    [True]
"""

from __future__ import annotations

import os

from zinfjax.errors import ConfigError

TRAIN = ("loss", "lr", "tokens_per_s")
TIME = ("step_s", "stall_s", "compute_s", "overlap", "io_floor_s", "floor_ratio", "io_ratio")


def tags(record: dict) -> dict[str, float]:
    """The scalars of one step's log entry, by TensorBoard tag."""
    out = {f"train/{k}": record[k] for k in TRAIN if k in record}
    out.update({f"time/{k}": record[k] for k in TIME if k in record})
    for key, value in record.items():  # read_bytes_nvme, write_bytes_host, ... (not the per-device figures)
        op, _, tier = key.partition("_bytes_")
        if op in ("read", "write") and tier and "_" not in tier:
            out[f"bytes/{op}_{tier}"] = value
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}


def check_writable_dir(path: str, key: str = "tensorboard_dir") -> None:
    """Refuses a directory (the value of config ``key``) that cannot be made or written, in one line.

    A directory it made stays (empty); a file created to try is removed.
    """
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={path} is a file; give a directory, e.g. {key}={path}.d")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".zinfjax-write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{key}={path} cannot be written ({e.strerror or e}); choose a writable directory") from e


class Board:
    """A tensorboardX ``SummaryWriter`` under ``logdir`` that takes the log's step entries."""

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=logdir)

    def write(self, record: dict) -> None:
        """Adds the step's scalars (`tags`) at ``record["step"]``."""
        for tag, value in tags(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        """Flushes the events to disk and closes the file."""
        self.writer.close()
