"""Hugging Face config.json (GPT2Config, LlamaConfig, BertConfig) to zinfjax `ModelConfig`, and back.

Example (GPT-2's config.json, the keys that set the model):
    >>> gpt2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
    ...         "n_head": 12, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
    >>> config = from_hf_config(gpt2)
    >>> config == ModelConfig.named("gpt2-small"), to_hf_config(config)["n_embd"]
    (True, 768)
"""

from __future__ import annotations

from typing import Any

from zinfjax.models import ModelConfig
from zinfjax_interop.errors import UnknownArchitectureError, UnsupportedConfigError
from zinfjax_interop.tables import BY_ARCH, TABLES

_NEEDED = object()
GPT2_EOS = 50256  # GPT2Config's default bos and eos token id: <|endoftext|>

# The variant each zinfjax model computes; a config.json that asks for another is refused, naming the
# key. The first value is HF's default (assumed when the key is absent) and the one `to_hf_config` writes.
REQUIRED: dict[str, dict[str, tuple]] = {
    "gpt2": {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both the tanh approximation
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "add_cross_attention": (False,),
        "tie_word_embeddings": (True,),
    },
    "llama": {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)},
    "bert": {
        "hidden_act": ("gelu",),  # exact (erf) GELU
        "position_embedding_type": ("absolute",),
        "is_decoder": (False,),
        "add_cross_attention": (False,),
    },
}


def from_hf_config(hf: dict[str, Any]) -> ModelConfig:
    """The zinfjax `ModelConfig` of an HF config.json's contents.

    Example:
        >>> from_hf_config({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
        ...                 "n_layer": 12, "n_head": 12}).arch
        'gpt2'
        >>> from_hf_config({"model_type": "t5"})
        Traceback (most recent call last):
        zinfjax_interop.errors.UnknownArchitectureError: config.json has model_type 't5', which zinfjax cannot ...
    """
    model_type = hf.get("model_type")
    if model_type not in TABLES:
        raise UnknownArchitectureError(
            f"config.json has model_type {model_type!r}, which zinfjax cannot convert; "
            f"supported: {', '.join(TABLES)}"
        )
    for key, allowed in REQUIRED[model_type].items():
        if hf.get(key, allowed[0]) not in allowed:
            raise UnsupportedConfigError(
                f"config.json sets {key}={hf[key]!r}; the zinfjax {model_type} model computes only "
                f"{key} in {list(allowed)}"
            )
    return _FROM_HF[model_type](lambda key, default=_NEEDED: _get(hf, model_type, key, default))


def to_hf_config(config: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The HF config.json contents for ``config``; ``dtype`` is the weights' dtype name.

    Example:
        >>> to_hf_config(ModelConfig.named("llama-tiny"))["num_key_value_heads"]
        8
    """
    if config.arch not in BY_ARCH:
        raise UnknownArchitectureError(f"zinfjax cannot export arch {config.arch!r}; supported: {', '.join(BY_ARCH)}")
    table = BY_ARCH[config.arch]
    out = {"model_type": table.model_type, "architectures": [table.export_as], "dtype": dtype}
    out |= {key: allowed[0] for key, allowed in REQUIRED[table.model_type].items()}
    if config.arch == "gpt2" and config.vocab_size <= GPT2_EOS:  # HF's default ids would lie outside the vocabulary
        out |= {"bos_token_id": None, "eos_token_id": None}
    return out | _TO_HF[config.arch](config)


def _get(hf: dict, model_type: str, key: str, default: Any) -> Any:
    value = hf.get(key)
    if value is None and default is _NEEDED:
        raise UnsupportedConfigError(f"config.json of a {model_type} model lacks {key!r}")
    return default if value is None else value


def _gpt2(get) -> ModelConfig:
    d = get("n_embd")
    return ModelConfig(
        "gpt2", get("vocab_size"), get("n_positions"), d, get("n_layer"), get("n_head"),
        get("n_inner", 4 * d), tied=True, norm_eps=get("layer_norm_epsilon", 1e-5),
    )


def _llama(get) -> ModelConfig:
    d, heads = get("hidden_size"), get("num_attention_heads")
    if get("head_dim", d // heads) * heads != d:
        raise UnsupportedConfigError(
            f"config.json sets head_dim={get('head_dim')}; the zinfjax llama model needs "
            f"head_dim = hidden_size / num_attention_heads = {d // heads}"
        )
    return ModelConfig(
        "llama", get("vocab_size"), get("max_position_embeddings"), d, get("num_hidden_layers"), heads,
        get("intermediate_size"), n_kv_heads=get("num_key_value_heads", heads),
        tied=get("tie_word_embeddings", False), norm_eps=get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(get),
    )


def _rope_theta(get) -> float:
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_theta and rope_scaling.
    for key in ("rope_parameters", "rope_scaling"):
        rope = get(key, {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise UnsupportedConfigError(
                f"config.json sets {key} with rope_type {kind!r}; the zinfjax llama model computes only "
                "the default rotary embedding"
            )
    return float(get("rope_parameters", {}).get("rope_theta") or get("rope_theta", 10000.0))


def _bert(get) -> ModelConfig:
    return ModelConfig(
        "bert", get("vocab_size"), get("max_position_embeddings"), get("hidden_size"), get("num_hidden_layers"),
        get("num_attention_heads"), get("intermediate_size"), tied=False, norm_eps=get("layer_norm_eps", 1e-12),
        type_vocab_size=get("type_vocab_size", 2),
    )


_FROM_HF = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}

_TO_HF = {
    "gpt2": lambda c: {
        "vocab_size": c.vocab_size, "n_positions": c.max_seq_len, "n_embd": c.d_model, "n_layer": c.n_layers,
        "n_head": c.n_heads, "n_inner": c.d_ff, "layer_norm_epsilon": c.norm_eps,
    },
    "llama": lambda c: {
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len, "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.d_ff, "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tied, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
    },
    "bert": lambda c: {
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len, "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "intermediate_size": c.d_ff,
        "layer_norm_eps": c.norm_eps, "type_vocab_size": c.type_vocab_size,
    },
}
