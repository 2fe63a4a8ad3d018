"""Offloaded inference: generation and evaluation with parameters streamed from every tier."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tests.support.engine_helpers import batches, config, make_engine
from tests.support.hf_text import TEXT, adapter_run, converted_gpt2
from tests.support.tolerances import assert_loss_no_farther, in_float64
from tests.support.xla_flags import child_env
from zinfjax import Config, models
from zinfjax.checkpoint import CheckpointManager
from zinfjax.checkpoint.tokenizer import model_tokens
from zinfjax.cli import main
from zinfjax.errors import UserError
from zinfjax.inference import Sampling, evaluate, generate
from zinfjax_interop import load_hf

transformers.utils.logging.disable_progress_bar()
PROMPTS = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100], [1, 2, 3, 4, 5]]


def full_forward_greedy(model, params, prompt, n):
    """Greedy decoding by running the whole sequence through the model for every token (no cache)."""
    seq, length = list(prompt), len(prompt) + n
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))  # one shape: causal, so the
    for _ in range(n):                                                          # padding after seq is unseen
        logits = forward(jnp.asarray([seq + [0] * (length - len(seq))]))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A gpt2-tiny trained 3 steps and saved, with its model recorded (as `zinfjax train` saves)."""
    root = tmp_path_factory.mktemp("trained")
    c = config(mesh="data:1", params="host")
    engine, data = make_engine(c), batches(c)
    for _ in range(3):
        engine.train_step(next(data))
    with CheckpointManager(str(root / "ckpt"), config=c, model=models.ModelConfig.named("gpt2-tiny")) as manager:
        manager.save(engine)
    params = jax.tree.map(np.asarray, engine.params())
    engine.close()
    return str(root / "ckpt"), params


@pytest.mark.numeric  # tokens from the same arithmetic, equal
def test_greedy_from_nvme_equals_in_memory_and_the_uncached_model(trained_checkpoint, tmp_path):
    path, params = trained_checkpoint
    memory = generate(path, PROMPTS, 10, Config())
    nvme = generate(path, PROMPTS, 10, Config(params="nvme", kv_cache="nvme", nvme_path=str(tmp_path)))
    host = generate(path, PROMPTS, 10, Config(params="host", kv_cache="host", prefetch_depth=0))
    assert nvme.tokens == memory.tokens == host.tokens
    assert nvme.metrics["read_bytes_nvme"] > 0
    model = models.build("gpt2-tiny")
    assert memory.tokens[0] == full_forward_greedy(model, params, PROMPTS[0], 10)


@pytest.mark.numeric  # greedy tokens equal transformers': argmaxes of logits computed by both
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_equals_transformers_generate(tmp_path, arch):
    torch.manual_seed(0)
    if arch == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2))
    hf.eval().save_pretrained(tmp_path)
    model_config, params = load_hf(str(tmp_path))
    prompt = [[5, 17, 42, 8, 3, 61]]
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None)
    got = generate(params, prompt, 12, Config(params="host"), model=model_config)
    assert got.tokens == want.tolist()


@pytest.mark.numeric  # tokens from the same arithmetic, equal
def test_sampling_is_seeded_and_top_k_1_is_greedy(trained_checkpoint):
    path, _ = trained_checkpoint
    sample = lambda **kw: generate(path, PROMPTS[:1], 12, Config(), Sampling(**kw)).tokens  # noqa: E731
    assert sample(temperature=1.0, seed=1) == sample(temperature=1.0, seed=1)
    assert sample(temperature=1.0, seed=1) != sample(temperature=1.0, seed=2)
    assert sample(temperature=1.0, top_k=1, seed=3) == sample()
    assert sample(temperature=0.7, top_p=1e-6, seed=4) == sample()  # the nucleus keeps the most likely token


@pytest.mark.numeric
def test_evaluate_streams_the_loss_of_the_model(trained_checkpoint, tmp_path):
    path, params = trained_checkpoint
    c = Config(params="nvme", nvme_path=str(tmp_path), batch_size=4, seq_len=32, seed=5)
    out = evaluate(path, "demo", c, batches=2)
    model = models.build("gpt2-tiny")
    from zinfjax.data import Batches, load_tokens

    data = Batches(load_tokens("demo"), 4, 32, 5)
    two = [next(data), next(data)]
    want = [float(model.apply({"params": params}, b[:, :-1], b[:, 1:])) for b in two]
    with jax.enable_x64(True):  # the model's losses in float64: the truth the fp32 ones are judged against
        wide = models.build("gpt2-tiny", jnp.float64)
        exact = [wide.apply({"params": in_float64(params)}, b[:, :-1], b[:, 1:]) for b in two]
        assert all(x.dtype == jnp.float64 for x in exact)
    # streamed, no farther from the losses in float64 than the whole model's in fp32 (tests/support/tolerances.py)
    assert_loss_no_farther([float(x) for x in exact], want, out["losses"], terms=two[0][:, 1:].size)
    assert out["perplexity"] == math.exp(float(np.mean(out["losses"])))  # the same arithmetic as evaluate's


def test_bad_input_is_refused_clearly(trained_checkpoint, tmp_path):
    path, _ = trained_checkpoint
    with pytest.raises(UserError, match="more than the model's context of 128"):
        generate(path, [[1] * 120], 10, Config())
    with pytest.raises(UserError, match="one length"):
        generate(path, [[1, 2], [1, 2, 3]], 2, Config())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no complete checkpoint"):
        generate(str(empty), [[1]], 2, Config())
    no_params = tmp_path / "no_params" / "0"
    no_params.mkdir(parents=True)
    meta = json.loads(open(os.path.join(path, "3", "zinfjax.json")).read())
    (no_params / "zinfjax.json").write_text(json.dumps({**meta, "step": 0, "items": {"params": {}, "opt_state": {}}}))
    with pytest.raises(UserError, match="holds no parameters"):
        generate(str(no_params.parent), [[1]], 2, Config())
    (no_params / "zinfjax.json").write_text(json.dumps({"step": 0, "items": {"params": {}, "opt_state": {}}}))
    with pytest.raises(UserError, match="zinfjax.json is damaged: at the top level: 'format_version' is a required"):
        generate(str(no_params.parent), [[1]], 2, Config())
    cli = [sys.executable, "-m", "zinfjax.cli", "generate", path, "--prompt", "Hi", "--tokenizer", "nope"]
    out = subprocess.run(cli, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("zinfjax: error: unknown tokenizer 'nope'")
    assert "Traceback" not in out.stderr


@pytest.mark.numeric  # tokens from the same arithmetic, equal
def test_cli_generate_json(trained_checkpoint, tmp_path):
    path, _ = trained_checkpoint
    cli = [sys.executable, "-m", "zinfjax.cli", "generate", path, "--prompt-ids", "72,101", "--max-new-tokens", "4",
           "--batch-size", "2", "--json", "--set", "params=nvme", "--set", f"nvme_path={tmp_path}"]
    out = subprocess.run(cli, capture_output=True, text=True, env=child_env())  # one device, the tests' XLA flags
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [len(t) for t in result["tokens"]] == [6, 6] and result["tokens"][0][:2] == [72, 101]
    assert result["tokens"] == generate(path, [[72, 101]] * 2, 4, Config()).tokens


# ---- text in and out: the model's own tokenizer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """A tiny HF GPT-2 with its own BPE (320 tokens) converted by `zinfjax convert`, a LoRA run on it whose
    checkpoint holds the adapters alone and names it as its base, and the tokenizer."""
    root = tmp_path_factory.mktemp("adapted")
    out, tok = converted_gpt2(root)
    return out, adapter_run(out, root), tok


def generated(capsys, checkpoint, prompt: str, *flags: str) -> list[int]:
    assert main(["generate", str(checkpoint), "--prompt", prompt, "--max-new-tokens", "2", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["tokens"][0]


def test_generate_tokenizes_the_prompt_with_the_tokenizer_beside_the_checkpoint_or_its_base(adapted, capsys):
    """`zinfjax generate` finds the tokenizer by the rule training uses: beside a converted model, beside the base
    an adapter run names; and ``--tokenizer X`` is ``--set tokenizer=X``."""
    out, run, tok = adapted
    prompt = "Line 3: the layer streams from disk"
    ids = tok(prompt)["input_ids"]
    for checkpoint in (out, run):
        tokens = generated(capsys, checkpoint, prompt)
        assert tokens[:len(ids)] == ids and len(tokens) == len(ids) + 2, checkpoint
    assert main(["generate", str(out), "--prompt", prompt, "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith(prompt)  # the output decoded by the same tokenizer
    as_bytes = list(prompt.encode())
    assert generated(capsys, out, prompt, "--tokenizer", "bytes")[:len(as_bytes)] == as_bytes
    assert generated(capsys, out, prompt, "--set", "tokenizer=bytes")[:len(as_bytes)] == as_bytes
    assert main(["generate", str(out), "--prompt", prompt, "--tokenizer", str(out / "tokenizer"), "--set",
                 "tokenizer=bytes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "name different tokenizers" in err[0], err


def test_evaluate_an_adapter_run_on_text_with_its_bases_tokenizer(adapted, tmp_path, capsys):
    out, run, _ = adapted
    notes = tmp_path / "notes.txt"
    notes.write_text(TEXT)
    assert model_tokens(str(notes), str(run), 320)[1] == str(out / "tokenizer")
    assert main(["evaluate", str(run), "--data", str(notes), "--batches", "2", "--json", "--set", "batch_size=8",
                 "--set", "seq_len=16"]) == 0, capsys.readouterr().err
    assert np.isfinite(json.loads(capsys.readouterr().out)["loss"])
