"""Generation with parameters streamed from their tier, batch-major, with a KV cache per layer on a tier.

Every decoding step streams the whole model once: embed, each block, head, each read ahead of
the compute that needs it (`ReadAhead`, ``config.prefetch_depth`` groups). All the sequences of
a batch pass through layer ``i`` before layer ``i + 1`` is read (FlexGen's batch-major order), so
one read of a layer's parameters serves every sequence, and throughput rises with the batch
size until compute dominates. Each layer's KV cache, for the whole batch, lives in its own store
on ``config.kv_cache`` (device, host or nvme) and is read and written back with its layer.

Example:
    >>> import jax, jax.numpy as jnp, tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> model = ModelConfig.named("gpt2-tiny")                 # a checkpoint of a (random) GPT-2
    >>> params = jax.jit(models.build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    >>> ckpt = write_params(tempfile.mkdtemp(), params, model=model)
    >>> result = generate(ckpt, [[72, 101, 108]], max_new_tokens=5,
    ...                   config=Config(params="nvme", kv_cache="host", nvme_path=tempfile.mkdtemp()))
    >>> result.tokens[0][:3], len(result.tokens[0]), result.metrics["read_bytes_nvme"] > 0
    ([72, 101, 108], 8, True)
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax import models
from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.checkpoint.model import checkpoint_model
from zinfjax.config import Config
from zinfjax.engine.readahead import Read, ReadAhead
from zinfjax.engine.stores import SCRATCH_NVME
from zinfjax.errors import ConfigError
from zinfjax.inference.params import ParamStores
from zinfjax.inference.sampling import Sampling, next_tokens
from zinfjax.models import ModelConfig
from zinfjax.store import open_store
from zinfjax.store.split import pieces_of


@dataclasses.dataclass
class GenerateResult:
    """The prompts followed by their new tokens (``tokens``, one list per sequence), and the figures."""

    tokens: list[list[int]]
    metrics: dict


class Generator:
    """Decodes a batch of equal-length prompts; see the module docstring.

    Example (parameters from a tree in memory, on the host tier):
        >>> import jax, jax.numpy as jnp
        >>> model = ModelConfig.named("gpt2-tiny")
        >>> params = jax.jit(models.build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> param_stores = ParamStores.from_tree(params, Config(params="host"))
        >>> gen = Generator(model, param_stores, param_stores.config, batch=8, max_len=16)
        >>> tokens, metrics = gen.run(np.full((8, 4), 72), max_new_tokens=4, sampling=Sampling())
        >>> tokens.shape                                   # each prompt's 4 tokens, then 4 new ones
        (8, 8)
        >>> gen.close(); param_stores.close()
    """

    def __init__(self, model_config: ModelConfig, params: ParamStores, config: Config, batch: int, max_len: int):
        if max_len > model_config.max_seq_len:
            raise ConfigError(f"prompt plus new tokens make {max_len} positions, more than the model's context of "
                              f"{model_config.max_seq_len}; shorten the prompt or ask for fewer new tokens")
        model = models.build(model_config, COMPUTE_DTYPES[config.precision])
        self.dec = model.decoding()
        if self.dec is None:
            raise ConfigError(f"a {model_config.arch} model is an encoder and cannot generate; use a causal LM "
                              "(gpt2, llama)")
        self.config, self.params, self.batch, self.max_len = params.config, params, batch, max_len
        self.num_layers = params.num_layers("blocks")
        layer = self.dec.cache_like(batch, max_len)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.num_layers, *x.shape), x.dtype), layer)
        options = SCRATCH_NVME if config.kv_cache == "nvme" else {}
        self.cache = open_store(config.kv_cache, like, path=config.nvme_path, name="kv_cache", pool=params.pool,
                                **options)
        self._zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), layer)
        self._fns = _jitted(self.dec)

    def run(self, prompts: np.ndarray, max_new_tokens: int, sampling: Sampling) -> tuple[np.ndarray, dict]:
        prompts = np.asarray(prompts, np.int32)
        for i in range(self.num_layers):
            self.cache.write(i, self._zeros)
        key = jax.random.key(sampling.seed)
        stores = [*self.params.stores.values(), self.cache]
        before = _bytes(stores)
        out, step_s, stall = [], [], 0.0
        start = time.perf_counter()
        tokens, pos = prompts, 0
        for step in range(max_new_tokens):
            t0 = time.perf_counter()
            logits, reads = self._forward(jnp.asarray(tokens), pos)
            new = next_tokens(logits, jax.random.fold_in(key, step), sampling.temperature, sampling.top_k,
                              sampling.top_p)
            out.append(np.asarray(new))
            stall += reads.stall_s
            pos += tokens.shape[1]
            tokens = out[-1][:, None]
            step_s.append(time.perf_counter() - t0)
        seconds = time.perf_counter() - start
        moved = {k: v - before.get(k, 0) for k, v in _bytes(stores).items()}
        generated = np.stack(out, axis=1) if out else np.zeros((len(prompts), 0), np.int32)
        return np.concatenate([prompts, generated], axis=1), {
            "sequences": len(prompts), "new_tokens": max_new_tokens, "seconds": seconds,
            "tokens_per_s": len(prompts) * max_new_tokens / seconds if seconds else 0.0,
            "first_step_s": step_s[0] if step_s else 0.0,
            "decode_step_s": float(np.median(step_s[1:])) if len(step_s) > 1 else None,
            "stall_s": stall, **{f"read_bytes_{t}": b for t, b in moved.items()},
        }

    def _forward(self, tokens: jax.Array, pos: int):
        s, L = self.params.stores, self.num_layers
        groups = [[Read("params_embed", s["embed"], 0)]]
        groups += [[Read("params_blocks", s["blocks"], i), Read("kv_cache", self.cache, i)] for i in range(L)]
        groups.append([Read("params_head", s["head"], 0), Read("params_embed", s["embed"], 0)])
        reads = ReadAhead(groups, self.params.memory.prefetch_depth)
        embed, block, head = self._fns
        p_pos = jnp.int32(pos)
        (pe,) = next(reads)
        h = embed(pe, tokens, p_pos)
        for i in range(L):
            p, cache = next(reads)
            h, cache = block(p, h, cache, p_pos)
            self.cache.write(i, cache)
        ph, pe = next(reads)
        return head(ph, pe, h), reads

    def close(self) -> None:
        self.cache.close()


@functools.cache
def _jitted(dec):
    return (jax.jit(dec.embed), jax.jit(dec.block), jax.jit(lambda ph, pe, h: dec.head(ph, pe, h[:, -1:])[:, 0]))


def _bytes(stores) -> dict[str, int]:
    out: dict[str, int] = {}
    for store in (piece for s in stores for _, piece in pieces_of(s)):
        out[store.tier] = out.get(store.tier, 0) + store.stats.bytes_read
    return out


def generate(source, prompts, max_new_tokens: int, config: Config | None = None, sampling: Sampling | None = None,
             model: ModelConfig | None = None) -> GenerateResult:
    """Generates ``max_new_tokens`` after each prompt, parameters streamed from ``config.params``.

    ``source`` is a zinfjax checkpoint (a save_dir or one step, as written by training or by
    ``zinfjax convert``) or an in-memory parameter tree (then pass ``model``). Prompts are lists
    of token ids of one length; they are decoded together, batch-major.

    Example (a tree in memory, on the device tier; the module docstring streams a checkpoint from NVMe):
        >>> import jax, jax.numpy as jnp
        >>> model = ModelConfig.named("gpt2-tiny")
        >>> params = jax.jit(models.build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> result = generate(params, [[1, 2, 3]] * 8, 4, model=model)     # greedy: the 8 rows alike
        >>> len(result.tokens), result.tokens[0][:3], len(result.tokens[0]), result.tokens[7] == result.tokens[0]
        (8, [1, 2, 3], 7, True)
    """
    config = config or Config()
    sampling = sampling or Sampling()
    prompts = check_prompts(prompts)
    check_counts(max_new_tokens, len(prompts))
    if isinstance(source, str):
        _, model = checkpoint_model(source)
    elif model is None:
        raise ConfigError("generate from a parameter tree needs its model: generate(params, ..., model=config)")
    check_prompts(prompts, model.vocab_size)
    if sampling.top_k > model.vocab_size:
        raise ConfigError(f"top_k={sampling.top_k} exceeds the model's vocabulary of {model.vocab_size}")
    if isinstance(source, str):
        params = ParamStores.from_checkpoint(source, abstract_params(model), config)
    else:
        params = ParamStores.from_tree(source, config)
    try:
        gen = Generator(model, params, config, len(prompts), prompts.shape[1] + max_new_tokens)
        try:
            tokens, metrics = gen.run(prompts, max_new_tokens, sampling)
        finally:
            gen.close()
    finally:
        params.close()
    return GenerateResult([list(map(int, row)) for row in tokens], metrics)


def check_prompts(prompts, vocab_size: int | None = None) -> np.ndarray:
    """Prompts as a (B, T) int32 array; they must share one length (decode them in groups of equal length).

    With ``vocab_size``, every id must be a token of the vocabulary: an id outside it would be
    embedded as garbage (JAX clamps out-of-range gathers) and decoded as nothing sensible.
    """
    rows = [list(p) for p in prompts]
    if not rows or not rows[0]:
        raise ConfigError("no prompt: give at least one token")
    if len({len(r) for r in rows}) > 1:
        raise ConfigError(f"prompts of lengths {sorted({len(r) for r in rows})}: a batch decodes prompts of one "
                          "length; group them by length")
    if vocab_size is not None:
        bad = sorted({int(t) for r in rows for t in r if not 0 <= int(t) < vocab_size})
        if bad:
            raise ConfigError(f"prompt token id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:10]))} "
                              f"{'are' if len(bad) > 1 else 'is'} outside the model's vocabulary of {vocab_size} "
                              f"(ids 0 to {vocab_size - 1})")
    return np.asarray(rows, np.int32)


def check_counts(max_new_tokens: int, batch_size: int) -> None:
    """Refuses a count of new tokens or of sequences below 1."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens} must be 1 or more")
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be 1 or more")


def parse_ids(text: str) -> list[int]:
    """``"1,2,3"`` as token ids; anything else is refused, naming the item.

    Example:
        >>> parse_ids("72, 105")
        [72, 105]
    """
    ids = []
    for item in text.split(","):
        try:
            ids.append(int(item.strip()))
        except ValueError:
            raise ConfigError(f"--prompt-ids {text!r}: {item.strip()!r} is not a token id; give comma-separated "
                              "integers, e.g. --prompt-ids 72,105") from None
    return ids


@functools.cache
def abstract_params(model: ModelConfig):
    """The parameter tree of ``model`` as ``ShapeDtypeStruct`` leaves (no memory)."""
    m = models.build(model)
    return jax.eval_shape(lambda: m.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
