"""Loss and perplexity of a checkpoint on a token source, parameters streamed from their tier.

Each batch of sequences streams the model once: embed, every block, head with the loss, each
layer read ahead of its compute, so a model larger than memory is evaluated with one layer (plus
the read-ahead) resident.

Example (a random GPT-2 on bytes: about the loss of a uniform guess over its 256 tokens, ln 256 = 5.5):
    >>> import tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> model = models.ModelConfig.named("gpt2-tiny")
    >>> params = jax.jit(models.build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    >>> ckpt = write_params(tempfile.mkdtemp(), params, model=model)
    >>> result = evaluate(ckpt, "demo", Config(params="nvme", nvme_path=tempfile.mkdtemp()), batches=4)
    >>> round(result["loss"], 1), result["tokens"]
    (5.5, 2048)
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax import models
from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.checkpoint.model import checkpoint_model
from zinfjax.checkpoint.tokenizer import model_tokens
from zinfjax.config import Config
from zinfjax.data import Batches
from zinfjax.engine.readahead import Read, ReadAhead
from zinfjax.errors import ConfigError
from zinfjax.inference.generate import abstract_params
from zinfjax.inference.params import ParamStores


def evaluate(source: str, data: str, config: Config, batches: int = 8, model=None) -> dict:
    """Mean token loss and perplexity over ``batches`` batches of ``config.batch_size`` x ``config.seq_len``.

    ``source`` is a zinfjax checkpoint (or a parameter tree, with ``model``); ``data`` a token source as
    `zinfjax.checkpoint.tokenizer.model_tokens` reads it (``demo``, text, a ``.bin`` file), text tokenized by the
    checkpoint's tokenizer (``config.tokenizer``, else the one kept beside it or beside the base it names).
    """
    if isinstance(source, str):
        _, model = checkpoint_model(source)
        params = ParamStores.from_checkpoint(source, abstract_params(model), config)
    else:
        params = ParamStores.from_tree(source, config)
    tokens, _ = model_tokens(data, source if isinstance(source, str) else "", model.vocab_size, config.tokenizer,
                             config.data_field)
    if config.seq_len > model.max_seq_len:
        raise ConfigError(f"seq_len={config.seq_len} exceeds the model's context of {model.max_seq_len}")
    layers = models.build(model, COMPUTE_DTYPES[config.precision]).layers()
    fns = _jitted(layers)
    data_batches = Batches(tokens, config.batch_size, config.seq_len, config.seed)
    losses, stall, start = [], 0.0, time.perf_counter()
    try:
        for _ in range(batches):
            batch = jnp.asarray(next(data_batches))
            loss, reads = _one_batch(params, fns, batch)
            losses.append(float(loss))
            stall += reads.stall_s
    finally:
        params.close()
    mean = float(np.mean(losses))
    seconds = time.perf_counter() - start
    n = batches * config.batch_size * config.seq_len
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": n, "batches": batches, "seconds": seconds,
            "tokens_per_s": n / seconds, "stall_s": stall, "losses": losses}


def _one_batch(params: ParamStores, fns, batch):
    s = params.stores
    L = s["blocks"].num_layers
    groups = [[Read("params_embed", s["embed"], 0)]] + [[Read("params_blocks", s["blocks"], i)] for i in range(L)]
    groups.append([Read("params_head", s["head"], 0), Read("params_embed", s["embed"], 0)])
    reads = ReadAhead(groups, params.memory.prefetch_depth)
    embed, block, head = fns
    (pe,) = next(reads)
    h = embed(pe, batch[:, :-1])
    for _ in range(L):
        (p,) = next(reads)
        h = block(p, h)
    ph, pe = next(reads)
    return head(ph, pe, h, batch[:, 1:]), reads


def _jitted(layers):
    return jax.jit(layers.embed), jax.jit(layers.block), jax.jit(layers.head)
