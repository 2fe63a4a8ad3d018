"""Offloaded inference: evaluation and generation with parameters streamed from their tier.

Example:
    >>> import jax, jax.numpy as jnp, tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> from zinfjax.models import ModelConfig, build
    >>> model = ModelConfig.named("gpt2-tiny")                 # a checkpoint of a (random) GPT-2
    >>> params = jax.jit(build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    >>> ckpt = write_params(tempfile.mkdtemp(), params, model=model)
    >>> from zinfjax import Config
    >>> from zinfjax.inference import Sampling, evaluate, generate
    >>> config = Config(params="nvme", nvme_path=tempfile.mkdtemp())
    >>> tokens = generate(ckpt, [[72, 101]], 6, config, Sampling(temperature=0.8, seed=1)).tokens
    >>> len(tokens[0]), tokens[0][:2]
    (8, [72, 101])
    >>> evaluate(ckpt, "demo", config, batches=2)["tokens"]
    1024
"""

from zinfjax.inference.evaluate import evaluate
from zinfjax.inference.generate import GenerateResult, Generator, generate
from zinfjax.inference.sampling import Sampling

__all__ = ["GenerateResult", "Generator", "Sampling", "evaluate", "generate"]
