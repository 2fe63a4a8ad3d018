"""A model at scale from its shapes alone: parameters, model-state bytes, activation checkpoints, and the
working memory of the units it streams, tiled or not.

Nothing is traced or allocated, so a 100-trillion-parameter `ModelConfig` costs microseconds. The
counts follow the reference models (zinfjax/models/gpt.py, llama.py, bert.py) leaf by leaf; the
formulas are in docs/planning.md, "Planning for another machine".

Example:
    >>> gpt = ModelConfig("gpt2", 50257, 1024, 25600, 128, 256, 102400)     # the ZeRO-Infinity paper's 1T row
    >>> round(parameter_count(gpt) / 1e12, 2)
    1.01
    >>> paper_working_memory(gpt, "fp16") / 2**30     # 4 bytes x d x 4d: the paper's 9.77 GB
    9.765625
    >>> tile_counts(gpt)[:6]
    [1, 2, 4, 8, 16, 32]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zinfjax.models.configs import ModelConfig, tile_counts

ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of one value in the compute dtype (Config.precision)

# fp32 values the optimizer keeps per parameter (optax's state): Adam's two moments, SGD's momentum (0.9)...
OPTIMIZER_SLOTS = {"adamw": 2, "adam": 2, "lamb": 2, "lion": 1, "sgd": 1, "adagrad": 1, "rmsprop": 1}
DEFAULT_SLOTS = 2  # an optimizer with no simple count (adafactor's factored moments) is counted as Adam


def block_parameters(m: ModelConfig) -> int:
    """Parameters of one block: attention, MLP, norms and biases, as the reference model declares them.

    Example:
        >>> block_parameters(ModelConfig.named("gpt2-small"))     # 12 d^2 + 13 d
        7087872
    """
    d, ff, q, kv = m.d_model, m.d_ff, m.n_heads * m.head_dim, m.kv_heads * m.head_dim  # q = d where heads divide d
    if m.arch == "llama":  # q, k, v, attn_out without biases; gate, up, down; two RMSNorms
        return 2 * d * q + 2 * d * kv + 3 * d * ff + 2 * d
    return 4 * d * q + 3 * q + 2 * d * ff + 6 * d + ff  # q, k, v, attn_out, fc, proj with biases; two LayerNorms


def outer_parameters(m: ModelConfig) -> int:
    """Parameters outside the blocks: the vocabulary table(s), positions, final norm (BERT: its embeddings and
    pooler)."""
    d, v = m.d_model, m.vocab_size
    if m.arch == "llama":
        return v * d * (1 if m.tied else 2) + d
    if m.arch == "bert":
        return (v + m.max_seq_len + m.type_vocab_size) * d + 2 * d + d * d + d
    return (v + m.max_seq_len) * d + 2 * d


def adapter_parameters(m: ModelConfig) -> int:
    """Parameters of one block's LoRA adapters (models/lora.py): ``r x (in + out)`` for each targeted projection.

    Example:
        >>> adapter_parameters(ModelConfig.named("gpt2-tiny").replace(lora_rank=4))   # q and v: 2 x 4 x (64 + 64)
        1024
    """
    if not m.lora_rank:
        return 0
    d, ff, q, kv = m.d_model, m.d_ff, m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    shapes = {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, ff), "up": (d, ff), "down": (ff, d)}
    return sum(m.lora_rank * sum(shapes[t]) for t in m.lora_targets)


def parameter_count(m: ModelConfig) -> int:
    """Every parameter of the model, LoRA adapters included: the one count the planners use (`zinfjax plan`,
    ``zinfjax plan --machine``) and the benchmarks report. A test holds it to ``jax.eval_shape`` of the models.

    Example:
        >>> parameter_count(ModelConfig.named("gpt2-small"))
        124439808
    """
    return m.n_layers * (block_parameters(m) + adapter_parameters(m)) + outer_parameters(m)


def optimizer_slots(name: str) -> tuple[int, bool]:
    """fp32 values per parameter in the state of optimizer ``name``, and whether that count is exact.

    Example:
        >>> optimizer_slots("adamw"), optimizer_slots("adafactor")
        ((2, True), (2, False))
    """
    return (OPTIMIZER_SLOTS[name], True) if name in OPTIMIZER_SLOTS else (DEFAULT_SLOTS, False)


def state_bytes(m: ModelConfig, precision: str, optimizer_name: str = "adamw") -> dict[str, int]:
    """Bytes of the model states: parameters and gradients in the compute dtype, the fp32 master (mixed
    precision only) and the optimizer state in fp32. The ZeRO papers' 16 bytes a parameter in fp16 + Adam.
    Not `zinfjax.planning.zero_memory.state_bytes`, a device's share of a traced tree under the engine's
    sharding rules, which counts gradients in fp32 as the engine's gradient tier holds them.

    Example:
        >>> s = state_bytes(ModelConfig.named("gpt2-small"), "fp16")
        >>> s["total"] == 16 * parameter_count(ModelConfig.named("gpt2-small"))
        True
    """
    psi, size = parameter_count(m), ITEMSIZE[precision]
    out = {"params": size * psi, "gradients": size * psi, "master": 4 * psi if precision != "fp32" else 0,
           "optimizer": 4 * optimizer_slots(optimizer_name)[0] * psi}
    out["total"] = sum(out.values())
    return out


def activation_checkpoint_bytes(m: ModelConfig, samples: int, seq_len: int, precision: str) -> int:
    """One hidden state per block per sample, in the compute dtype: ``samples x seq_len x d_model x n_layers x
    itemsize``; the paper's ``2 x bsz x seq x hd x nl / ci`` with one checkpoint per block (ci = 1) in fp16.

    Example:
        >>> activation_checkpoint_bytes(ModelConfig.named("gpt2-small"), 8, 1024, "bf16")  # 8*1024*768*12*2
        150994944
    """
    return samples * seq_len * m.d_model * m.n_layers * ITEMSIZE[precision]


def largest_matrix(m: ModelConfig) -> tuple[str, int, int]:
    """The largest single matrix of a block, as ``(name, rows, columns)``: the MLP's ``d_model x d_ff`` in every
    reference model with d_ff >= d_model."""
    d, kv = m.d_model, m.kv_heads * m.head_dim
    mats = [("mlp in (d_model x d_ff)", d, m.d_ff), ("attention q (d_model x d_model)", d, d),
            ("attention k (d_model x kv)", d, kv)]
    return max(mats, key=lambda t: t[1] * t[2])


def paper_working_memory(m: ModelConfig, precision: str) -> int:
    """The ZeRO-Infinity paper's "model state working memory" of a device: the parameters and gradients of the
    largest single matrix, untiled, in the compute dtype (fp16: 2 + 2 bytes a value; 4 x hd x 4hd for GPT)."""
    _, rows, cols = largest_matrix(m)
    return 2 * ITEMSIZE[precision] * rows * cols


@dataclass(frozen=True)
class Unit:
    """One unit the engine streams: its parameters, and the activations (values) its compute holds."""

    name: str
    params: int
    activations: int

    def working_bytes(self, precision: str) -> int:
        """Its parameters and their gradients, and its activations, in the compute dtype."""
        return ITEMSIZE[precision] * (2 * self.params + self.activations)


def units(m: ModelConfig, tiles: int, samples: int, seq_len: int) -> list[Unit]:
    """The units of one step at ``tiles`` tiles, for ``samples`` sequences of ``seq_len`` tokens on a device.

    A block's MLP splits along d_ff into ``tiles`` tiles (W_in[:, d_ff/T], its bias, W_out[d_ff/T, :];
    Llama: gate, up and down), attention into ``tiles`` groups of n_heads/T heads (q, k, v and the rows of
    attn_out of those heads, with their biases; under GQA each group takes kv_heads/T key-value heads:
    ``tiles`` is one of `zinfjax.models.configs.tile_counts`, so it divides kv_heads). What stays whole:
    the block's norms and output biases, a vocabulary chunk (``ModelConfig.chunks``), the position table
    (GPT-2, BERT).

    Activations, per token of the device's micro-batch (``rows = samples x seq_len``): a unit's input and
    output (d_model each) and the widths it makes; attention adds its probabilities, samples x heads x
    seq_len^2. See docs/planning.md for each count.
    """
    d, ff, rows = m.d_model, m.d_ff, samples * seq_len
    heads, kv = m.n_heads // tiles, math.ceil(m.kv_heads / tiles)
    q_w, kv_w = heads * m.head_dim, kv * m.head_dim
    if m.arch == "llama":
        mlp = Unit("mlp tile", 3 * d * ff // tiles, rows * (2 * d + 3 * ff // tiles))
        attention = Unit("attention group", 2 * d * q_w + 2 * d * kv_w,
                         rows * (2 * d + 2 * q_w + 2 * kv_w) + samples * heads * seq_len ** 2)
        rest = Unit("block remainder", 2 * d, rows * 2 * d)
    else:
        mlp = Unit("mlp tile", 2 * d * ff // tiles + ff // tiles, rows * (2 * d + 2 * ff // tiles))
        attention = Unit("attention group", 4 * d * q_w + 3 * q_w,
                         rows * (2 * d + 4 * q_w) + samples * heads * seq_len ** 2)
        rest = Unit("block remainder", 6 * d, rows * 2 * d)
    chunk_rows = -(-m.vocab_size // m.chunks)
    out = [mlp, attention, rest, Unit("vocabulary chunk", chunk_rows * d, rows * (d + chunk_rows))]
    if m.arch != "llama":
        out.append(Unit("position table", m.max_seq_len * d, rows * d))
    return out


def largest_unit(m: ModelConfig, tiles: int, samples: int, seq_len: int, precision: str) -> tuple[Unit, int]:
    """The unit of the most working memory at ``tiles`` tiles, and that memory in bytes.

    Example:
        >>> largest_unit(ModelConfig.named("gpt2-small"), 1, 8, 1024, "bf16")[0].name  # 8 x 12 x 1024^2 probabilities
        'attention group'
        >>> largest_unit(ModelConfig.named("gpt2-small"), 1, 1, 128, "bf16")[0].name
        'mlp tile'
    """
    unit = max(units(m, tiles, samples, seq_len), key=lambda u: u.working_bytes(precision))
    return unit, unit.working_bytes(precision)


def pick_tiles(m: ModelConfig, samples: int, seq_len: int, precision: str, budget: int) -> int | None:
    """The fewest tiles whose largest unit's working memory is at most ``budget`` bytes; None if none is.

    Example:
        >>> pick_tiles(ModelConfig("gpt2", 50257, 1024, 25600, 128, 256, 102400), 2, 1024, "fp16", 16 * 10**9)
        2
    """
    for t in tile_counts(m):
        if largest_unit(m, t, samples, seq_len, precision)[1] <= budget:
            return t
    return None
