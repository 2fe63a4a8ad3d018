"""Offloaded inference: evaluation and generation with parameters streamed from their tier.

Example:
    >>> from zinfjax.inference import Sampling, evaluate, generate
    >>> generate("runs/ckpt", [[72, 101]], 16, Config(params="nvme", nvme_path="/mnt/nv")).tokens
"""

from zinfjax.inference.evaluate import evaluate
from zinfjax.inference.generate import GenerateResult, Generator, generate
from zinfjax.inference.sampling import Sampling

__all__ = ["GenerateResult", "Generator", "Sampling", "evaluate", "generate"]
