"""``zinfjax train``: the loop over the data, with progress, checkpoints, non-finite losses, the log and the loss curve.

Example:
    >>> import os, tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.training import run
    >>> runs = tempfile.mkdtemp()
    >>> config = Config(model="gpt2-tiny", steps=2, seq_len=16, mesh="data:1", log=f"{runs}/demo.json")
    >>> log = run(config, progress=False)
    >>> len(log["steps"]), sorted(os.listdir(runs))                 # the JSON log and its loss curve
    (2, ['demo.json', 'demo.png'])
"""

from zinfjax.training.loop import run

__all__ = ["run"]
