"""zinfjax: ZeRO-Infinity for JAX.

Example:
    >>> import zinfjax
    >>> config = zinfjax.Config(stage=3, params="nvme", optimizer="nvme", nvme_path="/mnt/nvme/run1")
"""

from zinfjax.config import Config
from zinfjax.errors import ConfigError, UserError

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "UserError", "__version__"]
