"""Declarative maps between Hugging Face tensor names and zinfjax parameter paths.

One `ArchTable` per architecture. Each `Rule` names an HF tensor (``{i}`` stands for the layer
index), the zinfjax leaf or leaves it holds (several when HF fuses them, as GPT-2's ``c_attn``
fuses q, k and v), and the `Layout` that relates the two. Nothing else in `interop` knows a
tensor name: the readers and the writer only follow these tables.

Example:
    >>> rule = GPT2.rules[4]
    >>> rule.hf, rule.paths
    ('h.{i}.attn.c_attn.weight', ('blocks/q/kernel', 'blocks/k/kernel', 'blocks/v/kernel'))
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np


class Layout(enum.Enum):
    """How an HF tensor holds a zinfjax leaf. zinfjax kernels are ``(in..., out...)``, as flax stores them."""

    SAME = "same"  # the same shape: embeddings, norm scales, unsplit biases
    FLAT = "flat"  # a vector that zinfjax splits, e.g. a q bias (H*hd,) kept as (H, hd)
    LINEAR = "linear"  # a torch nn.Linear weight (out, in): transposed
    CONV1D = "conv1d"  # GPT-2's Conv1D weight (in, out): zinfjax's order already, flattened


def hf_shape(layout: Layout, zshape: tuple[int, ...], in_axes: int) -> tuple[int, ...]:
    """The HF shape of a zinfjax leaf of shape ``zshape`` (one layer's).

    Example:
        >>> hf_shape(Layout.LINEAR, (64, 8, 16), in_axes=1)   # a q kernel (D, H, hd)
        (128, 64)
    """
    n_in, n_out = math.prod(zshape[:in_axes]), math.prod(zshape[in_axes:])
    return {
        Layout.SAME: tuple(zshape),
        Layout.FLAT: (math.prod(zshape),),
        Layout.LINEAR: (n_out, n_in),
        Layout.CONV1D: (n_in, n_out),
    }[layout]


def to_zinfjax(layout: Layout, a: np.ndarray, zshape: tuple[int, ...]) -> np.ndarray:
    """An HF tensor (or one part of a fused one) in zinfjax's layout; values are moved, never changed.

    Example (a q projection's nn.Linear weight, (out, in), as a zinfjax kernel (D, H, hd)):
        >>> w = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
        >>> kernel = to_zinfjax(Layout.LINEAR, w, (64, 8, 16))
        >>> kernel.shape, kernel[3, 0, 5] == w[5, 3]
        ((64, 8, 16), np.True_)
    """
    return (a.T if layout is Layout.LINEAR else a).reshape(zshape)


def to_hf(layout: Layout, a: np.ndarray, in_axes: int) -> np.ndarray:
    """A zinfjax leaf (one layer's) in the HF layout; the inverse of `to_zinfjax`.

    Example:
        >>> kernel = np.arange(64 * 8 * 16, dtype=np.float32).reshape(64, 8, 16)      # a q kernel (D, H, hd)
        >>> w = to_hf(Layout.LINEAR, kernel, in_axes=1)
        >>> w.shape, bool((to_zinfjax(Layout.LINEAR, w, kernel.shape) == kernel).all())
        ((128, 64), True)
    """
    shape = hf_shape(layout, a.shape, in_axes)
    return a.reshape(shape[::-1]).T if layout is Layout.LINEAR else a.reshape(shape)


# The HF axis that a fused tensor concatenates its parts on: the output axis.
FUSE_AXIS = {Layout.SAME: 0, Layout.FLAT: 0, Layout.LINEAR: 0, Layout.CONV1D: 1}


@dataclass(frozen=True)
class Rule:
    """One HF tensor and the zinfjax leaves it holds.

    Args:
        hf: the HF name after the body prefix; ``{i}`` stands for the layer index.
        zinfjax: the zinfjax leaf path (``"blocks/q/kernel"``), or a tuple of paths that HF fuses
            along its output axis, or ``()`` for a tensor zinfjax does not keep (a buffer, a tied copy):
            it is skipped when present and not written.
        layout: how the HF tensor holds the leaf.
        in_axes: for kernels, how many leading zinfjax axes are the input (2 for an output
            projection (H, hd, D)).
        top: the name is outside the body prefix (``lm_head.weight`` beside ``transformer.``).
        when: ``"tied"`` or ``"untied"``: the rule holds only for such configs.

    Example:
        >>> rule = Rule("h.{i}.attn.c_proj.weight", "blocks/attn_out/kernel", Layout.CONV1D, in_axes=2)
        >>> rule.paths, hf_shape(rule.layout, (8, 8, 64), rule.in_axes)    # (H, hd, D) as Conv1D's (in, out)
        (('blocks/attn_out/kernel',), (64, 64))
    """

    hf: str
    zinfjax: str | tuple[str, ...]
    layout: Layout = Layout.SAME
    in_axes: int = 1
    top: bool = False
    when: str | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.zinfjax,) if isinstance(self.zinfjax, str) else self.zinfjax

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def skip(hf: str, **kw) -> Rule:
    """A tensor some checkpoints carry that zinfjax does not keep: a buffer, or a tied copy of the embedding."""
    return Rule(hf, (), **kw)


@dataclass(frozen=True)
class ArchTable:
    """How one architecture's HF checkpoints name its tensors.

    Args:
        model_type: ``model_type`` in the HF config.json.
        arch: the zinfjax `ModelConfig.arch`.
        export_as: the HF class that `save_hf` names in config.json ``architectures``.
        bodies: prefixes of the body's tensor names, e.g. ``"transformer."`` in ``GPT2LMHeadModel`` and
            ``""`` in ``GPT2Model``; the first is the one written.
        rules: every tensor, in the order they are written.
    """

    model_type: str
    arch: str
    export_as: str
    bodies: tuple[str, ...]
    rules: tuple[Rule, ...]

    def active(self, tied: bool) -> tuple[Rule, ...]:
        """The rules that hold for a tied or an untied config."""
        return tuple(r for r in self.rules if r.when in (None, "tied" if tied else "untied"))


QKV = ("blocks/q/{}", "blocks/k/{}", "blocks/v/{}")

GPT2 = ArchTable(
    model_type="gpt2",
    arch="gpt2",
    export_as="GPT2LMHeadModel",
    bodies=("transformer.", ""),
    rules=(
        Rule("wte.weight", "embed/wte/embedding"),
        Rule("wpe.weight", "embed/wpe/embedding"),
        Rule("h.{i}.ln_1.weight", "blocks/ln_1/scale"),
        Rule("h.{i}.ln_1.bias", "blocks/ln_1/bias"),
        Rule("h.{i}.attn.c_attn.weight", tuple(p.format("kernel") for p in QKV), Layout.CONV1D),
        Rule("h.{i}.attn.c_attn.bias", tuple(p.format("bias") for p in QKV), Layout.FLAT),
        Rule("h.{i}.attn.c_proj.weight", "blocks/attn_out/kernel", Layout.CONV1D, in_axes=2),
        Rule("h.{i}.attn.c_proj.bias", "blocks/attn_out/bias"),
        Rule("h.{i}.ln_2.weight", "blocks/ln_2/scale"),
        Rule("h.{i}.ln_2.bias", "blocks/ln_2/bias"),
        Rule("h.{i}.mlp.c_fc.weight", "blocks/fc/kernel", Layout.CONV1D),
        Rule("h.{i}.mlp.c_fc.bias", "blocks/fc/bias"),
        Rule("h.{i}.mlp.c_proj.weight", "blocks/proj/kernel", Layout.CONV1D),
        Rule("h.{i}.mlp.c_proj.bias", "blocks/proj/bias"),
        Rule("ln_f.weight", "head/ln_f/scale"),
        Rule("ln_f.bias", "head/ln_f/bias"),
        skip("lm_head.weight", top=True),  # GPT-2 always ties it to wte
        skip("h.{i}.attn.bias"),  # the causal-mask buffers of older checkpoints
        skip("h.{i}.attn.masked_bias"),
    ),
)

# Hugging Face's Llama already uses the rotate-half rotary layout that zinfjax uses, so q and k
# need no permutation (that permutation exists only between Meta's original files and HF's).
LLAMA = ArchTable(
    model_type="llama",
    arch="llama",
    export_as="LlamaForCausalLM",
    bodies=("model.", ""),
    rules=(
        Rule("embed_tokens.weight", "embed/wte/embedding"),
        Rule("layers.{i}.input_layernorm.weight", "blocks/attn_norm/scale"),
        Rule("layers.{i}.self_attn.q_proj.weight", "blocks/q/kernel", Layout.LINEAR),
        Rule("layers.{i}.self_attn.k_proj.weight", "blocks/k/kernel", Layout.LINEAR),
        Rule("layers.{i}.self_attn.v_proj.weight", "blocks/v/kernel", Layout.LINEAR),
        Rule("layers.{i}.self_attn.o_proj.weight", "blocks/attn_out/kernel", Layout.LINEAR, in_axes=2),
        Rule("layers.{i}.post_attention_layernorm.weight", "blocks/mlp_norm/scale"),
        Rule("layers.{i}.mlp.gate_proj.weight", "blocks/gate/kernel", Layout.LINEAR),
        Rule("layers.{i}.mlp.up_proj.weight", "blocks/up/kernel", Layout.LINEAR),
        Rule("layers.{i}.mlp.down_proj.weight", "blocks/down/kernel", Layout.LINEAR),
        Rule("norm.weight", "head/norm/scale"),
        Rule("lm_head.weight", "head/lm_head/embedding", top=True, when="untied"),
        skip("lm_head.weight", top=True, when="tied"),  # a copy of embed_tokens, if saved at all
        skip("layers.{i}.self_attn.rotary_emb.inv_freq"),  # a buffer of older checkpoints
    ),
)

_BERT_LAYER = "encoder.layer.{i}."

BERT = ArchTable(
    model_type="bert",
    arch="bert",
    export_as="BertModel",
    bodies=("", "bert."),
    rules=(
        Rule("embeddings.word_embeddings.weight", "embed/word/embedding"),
        Rule("embeddings.position_embeddings.weight", "embed/position/embedding"),
        Rule("embeddings.token_type_embeddings.weight", "embed/token_type/embedding"),
        Rule("embeddings.LayerNorm.weight", "embed/norm/scale"),
        Rule("embeddings.LayerNorm.bias", "embed/norm/bias"),
        Rule(_BERT_LAYER + "attention.self.query.weight", "blocks/q/kernel", Layout.LINEAR),
        Rule(_BERT_LAYER + "attention.self.query.bias", "blocks/q/bias", Layout.FLAT),
        Rule(_BERT_LAYER + "attention.self.key.weight", "blocks/k/kernel", Layout.LINEAR),
        Rule(_BERT_LAYER + "attention.self.key.bias", "blocks/k/bias", Layout.FLAT),
        Rule(_BERT_LAYER + "attention.self.value.weight", "blocks/v/kernel", Layout.LINEAR),
        Rule(_BERT_LAYER + "attention.self.value.bias", "blocks/v/bias", Layout.FLAT),
        Rule(_BERT_LAYER + "attention.output.dense.weight", "blocks/attn_out/kernel", Layout.LINEAR, in_axes=2),
        Rule(_BERT_LAYER + "attention.output.dense.bias", "blocks/attn_out/bias"),
        Rule(_BERT_LAYER + "attention.output.LayerNorm.weight", "blocks/attn_norm/scale"),
        Rule(_BERT_LAYER + "attention.output.LayerNorm.bias", "blocks/attn_norm/bias"),
        Rule(_BERT_LAYER + "intermediate.dense.weight", "blocks/fc/kernel", Layout.LINEAR),
        Rule(_BERT_LAYER + "intermediate.dense.bias", "blocks/fc/bias"),
        Rule(_BERT_LAYER + "output.dense.weight", "blocks/proj/kernel", Layout.LINEAR),
        Rule(_BERT_LAYER + "output.dense.bias", "blocks/proj/bias"),
        Rule(_BERT_LAYER + "output.LayerNorm.weight", "blocks/mlp_norm/scale"),
        Rule(_BERT_LAYER + "output.LayerNorm.bias", "blocks/mlp_norm/bias"),
        Rule("pooler.dense.weight", "head/pooler/kernel", Layout.LINEAR),
        Rule("pooler.dense.bias", "head/pooler/bias"),
        skip("embeddings.position_ids"),  # buffers: arange(max_seq_len) and zeros
        skip("embeddings.token_type_ids"),
    ),
)

TABLES: dict[str, ArchTable] = {t.model_type: t for t in (GPT2, LLAMA, BERT)}
BY_ARCH: dict[str, ArchTable] = {t.arch: t for t in TABLES.values()}
