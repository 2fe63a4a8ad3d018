"""Small Hugging Face models built from configs with seeded random weights, saved as each file layout.

Shared by the interop tests; nothing is downloaded.
"""

import os

import numpy as np
import safetensors.torch
import torch
import transformers

VOCAB = 97
# Weights well above HF's default 0.02 make attention peaked, so a wrong q/k layout shows in the logits.
INIT = 0.2


def gpt2_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                   initializer_range=INIT, bos_token_id=0, eos_token_id=0)


def llama_config(tied):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, initializer_range=INIT,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, bos_token_id=0, eos_token_id=0,
    )


CASES = {
    "gpt2": (gpt2_config, transformers.GPT2LMHeadModel, "safetensors"),
    "gpt2-bin": (gpt2_config, transformers.GPT2LMHeadModel, "bin"),
    "llama-gqa": (lambda: llama_config(tied=False), transformers.LlamaForCausalLM, "safetensors"),
    "llama-gqa-tied-sharded": (lambda: llama_config(tied=True), transformers.LlamaForCausalLM, "sharded"),
}
# Tensors of an original checkpoint that zinfjax does not keep and so does not write back.
DROPPED = {"gpt2-bin": {"lm_head.weight"}, "minilm": {"embeddings.position_ids"}}


def save_case(name, directory):
    make_config, cls, files = CASES[name]
    torch.manual_seed(0)
    model = cls(make_config()).eval()
    if files == "bin":  # what transformers 4 wrote with safe_serialization=False: the state dict, tied copy included
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), os.path.join(directory, "pytorch_model.bin"))
    else:
        model.save_pretrained(directory, max_shard_size="20KB" if files == "sharded" else "5GB")
    return model


def tokens(batch=2, length=16, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def rel_diff(ours, ref):
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


def original_tensors(directory):
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out |= safetensors.torch.load_file(os.path.join(directory, f))
        elif f == "pytorch_model.bin":
            out |= torch.load(os.path.join(directory, f), weights_only=True)
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
