"""``zinfjax train``: the loop over the data, with progress, checkpoints, non-finite losses, the log and the loss curve.

Example:
    >>> from zinfjax.training import run
    >>> log = run(Config(model="gpt2-tiny", steps=50, log="runs/demo.json"))
"""

from zinfjax.training.loop import run

__all__ = ["run"]
