"""LoRA adapters between zinfjax and PEFT, through ``zinfjax convert``, against real torch + transformers + peft.

A tiny Llama built by transformers is converted to zinfjax; LoRA checkpoints with non-zero adapters
(every leaf, or the adapters alone naming that base) go ``--to peft`` and ``--to hf --merge``, and peft
and transformers must give zinfjax's logits. A PEFT adapter trained a few steps by torch comes back
``--base`` and must give peft's. Nothing is downloaded.

"Give zinfjax's logits": zinfjax's fp32 logits are no farther from the torch model's in float64 (``.double()``)
than torch's own fp32 logits are, within ``SLACK`` (whole-array relative L2; tests/support/tolerances.py).
"""

import copy
import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import peft  # noqa: E402
import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import traverse_util  # noqa: E402

from tests.support.tolerances import assert_loss_no_farther, assert_no_farther, in_float64  # noqa: E402
from zinfjax import Config, models  # noqa: E402
from zinfjax.checkpoint import CheckpointWriter, expected_leaves, read_meta  # noqa: E402
from zinfjax.checkpoint.base import base_ref  # noqa: E402
from zinfjax.cli import main  # noqa: E402
from zinfjax.data import Batches, load_tokens  # noqa: E402
from zinfjax.models import ModelConfig  # noqa: E402
from zinfjax.models.lora import TARGETS  # noqa: E402
from zinfjax.training.loop import run  # noqa: E402
from zinfjax_interop.convert import ZinfjaxCheckpoint  # noqa: E402
from zinfjax_interop.peft import adapter_shapes, without_lora  # noqa: E402

transformers.utils.logging.disable_progress_bar()
# peft 0.21 asks transformers 5 for a property it deprecated
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
VOCAB = 256
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=0, eos_token_id=0)


def convert(capsys, *argv) -> tuple[int, str]:
    code = main(["convert", *map(str, argv), "--quiet", "--json"])
    out = capsys.readouterr()
    return code, out.out if code == 0 else out.err


def convert_ok(capsys, *argv) -> dict:
    code, out = convert(capsys, *argv)
    assert code == 0, out
    return json.loads(out)


def refused(capsys, *argv) -> str:
    code, err = convert(capsys, *argv)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The HF llama's directory, and its zinfjax conversion (a save_dir) with its params as numpy."""
    root = tmp_path_factory.mktemp("peft")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(root / "hf")
    assert main(["convert", str(root / "hf"), str(root / "base"), "--quiet"]) == 0
    return str(root / "hf"), str(root / "base"), read_params(str(root / "base"))


def read_params(path: str) -> dict[str, np.ndarray]:
    """Every params leaf of a zinfjax checkpoint, adapters included (from the base where it names one), stacked."""
    with ZinfjaxCheckpoint(path) as ckpt:
        return {p: np.stack([ckpt.read(p, i) for i in range(s.shape[0])]) if p.startswith("blocks/")
                else ckpt.read(p, None) for p, s in {**ckpt.like, **ckpt.adapters}.items()}


def write_checkpoint(save_dir, model: ModelConfig, flat: dict, base: str | None = None) -> str:
    """``flat`` as a zinfjax checkpoint ``save_dir/1`` with no optimizer state, naming ``base`` if given."""
    f32 = traverse_util.unflatten_dict({p: a.astype(np.float32) for p, a in flat.items()}, sep="/")
    leaves = {"params": expected_leaves(f32, optax.set_to_zero())["params"], "opt_state": {}}
    with CheckpointWriter(str(save_dir), 1, leaves, model=model, base=base_ref(base) if base else None) as w:
        for p, a in flat.items():
            for layer in range(a.shape[0]) if p.startswith("blocks/") else [None]:
                w.write("params", p.replace("/", "."), layer, (a if layer is None else a[layer]).astype(np.float32))
    return os.path.join(str(save_dir), "1")


def lora_checkpoint(base, save_dir, targets, form: str):
    """A LoRA checkpoint on ``base`` with random non-zero adapters: every leaf (``full``) or the adapters alone."""
    _, base_dir, params = base
    model = ZinfjaxCheckpoint(base_dir).config.replace(lora_rank=4, lora_alpha=8.0, lora_targets=tuple(targets))
    rng = np.random.default_rng(len(targets))
    adapters = {p: rng.normal(0, 0.1, s).astype(np.float32) for p, s in adapter_shapes(model).items()}
    path = write_checkpoint(save_dir, model, adapters if form == "base" else {**params, **adapters},
                            base_dir if form == "base" else None)
    return path, model, {**params, **adapters}


def zinfjax_logits(model: ModelConfig, flat: dict) -> np.ndarray:
    tree = traverse_util.unflatten_dict(flat, sep="/")
    return np.asarray(models.build(model).apply({"params": tree}, jnp.asarray(TOKENS)), np.float64)


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS)).logits.double().numpy()


def assert_torchs_logits(capsys, case: str, ours, model) -> None:
    """``ours`` (zinfjax's fp32 logits) no farther from ``model``'s logits in float64 than its fp32 logits are."""
    exact = copy.deepcopy(model).double()
    assert all(p.dtype == torch.float64 for p in exact.parameters())  # no silent fp32: the truth is float64
    theirs, exact = torch_logits(model), torch_logits(exact)
    with capsys.disabled():
        print(f"\n{case}: max abs logit difference {np.max(np.abs(ours - theirs)):.2e}, "
              f"largest {np.abs(ours).max():.2f}")
        assert_no_farther(exact, theirs, ours)


@pytest.mark.numeric
@pytest.mark.parametrize("targets", [("q", "v"), TARGETS], ids=["q,v", "all"])
@pytest.mark.parametrize("form", ["full", "base"])
def test_a_lora_checkpoint_loads_in_peft_with_zinfjax_logits(base, tmp_path, capsys, targets, form):
    path, model, flat = lora_checkpoint(base, tmp_path / "lora", targets, form)
    convert_ok(capsys, path, tmp_path / "adapter", "--to", "peft")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    hf = transformers.LlamaForCausalLM.from_pretrained(base[0])
    ours = zinfjax_logits(model, flat)
    assert_torchs_logits(capsys, f"--to peft, {','.join(targets)}, {form}", ours,
                         peft.PeftModel.from_pretrained(hf, tmp_path / "adapter"))
    assert np.max(np.abs(ours - zinfjax_logits(without_lora(model), base[2]))) > 0.1


@pytest.mark.numeric
def test_merge_writes_the_adapted_model_that_transformers_loads(base, tmp_path, capsys):
    path, model, flat = lora_checkpoint(base, tmp_path / "lora", TARGETS, "base")
    out = convert_ok(capsys, path, tmp_path / "merged", "--to", "hf", "--merge")
    assert out["model"]["lora_rank"] == 0
    hf_config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert not any("lora" in k for k in hf_config)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_torchs_logits(capsys, "--to hf --merge, every target", zinfjax_logits(model, flat), merged)


def trained_peft_adapter(hf_dir: str, out) -> torch.nn.Module:
    """A PEFT LoRA (r=4, alpha=8 on q_proj, v_proj) trained 3 AdamW steps on random tokens, saved to ``out``; in
    eval mode (no dropout) on return."""
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    lora_dropout=0.05, task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    model.train()
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.numeric
def test_a_peft_adapter_converts_onto_its_base_with_peft_logits(base, tmp_path, capsys):
    hf_dir, base_dir, _ = base
    adapter = trained_peft_adapter(hf_dir, tmp_path / "adapter")
    out = convert_ok(capsys, tmp_path / "adapter", tmp_path / "lora", "--base", base_dir)
    meta = read_meta(out["path"])
    assert meta["items"]["opt_state"] == {} and meta["base"]["path"] == os.path.join(base_dir, "0")
    assert sorted(meta["items"]["params"]) == ["blocks.q_lora.a", "blocks.q_lora.b", "blocks.v_lora.a",
                                               "blocks.v_lora.b"]
    lora = {k: v for k, v in meta["model"].items() if k.startswith("lora_")}
    assert lora == {"lora_rank": 4, "lora_alpha": 8, "lora_targets": ["q", "v"], "lora_dropout": 0.05}
    flat = read_params(out["path"])
    assert np.abs(flat["blocks/q_lora/b"]).max() > 1e-3  # trained: B is no longer zero
    assert_torchs_logits(capsys, "PEFT -> zinfjax, a trained q,v adapter",
                         zinfjax_logits(ZinfjaxCheckpoint(out["path"]).config, flat), adapter)
    convert_ok(capsys, out["path"], tmp_path / "again", "--to", "peft")  # and back: the same tensors, bit for bit
    before = safetensors.torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    after = safetensors.torch.load_file(tmp_path / "again" / "adapter_model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "again" / "adapter_config.json").read_text())["lora_dropout"] == 0.05


@pytest.mark.numeric
def test_an_imported_peft_adapter_trains_on_through_zinfjax_train(base, tmp_path, capsys):
    """``model=<the imported adapter>``: the first step's loss is the imported model's own, the adapters move,
    and the run's checkpoints hold adapters alone, naming the base the adapter was converted onto."""
    hf_dir, base_dir, _ = base
    trained_peft_adapter(hf_dir, tmp_path / "adapter")
    out = convert_ok(capsys, tmp_path / "adapter", tmp_path / "lora", "--base", base_dir)
    c = Config(model=out["path"], lora_rank=4, lora_alpha=8.0, lora_targets="q,v", batch_size=8, seq_len=12,
               steps=3, save_dir=str(tmp_path / "run"), log=str(tmp_path / "log.json"))
    log = run(c, progress=False)
    flat = read_params(out["path"])
    batch = next(Batches(load_tokens("demo"), 8, 12, 0))
    model = ZinfjaxCheckpoint(out["path"]).config.replace(lora_dropout=0.0)
    tree = traverse_util.unflatten_dict(flat, sep="/")

    def loss(dtype):
        with jax.enable_x64(dtype == jnp.float64):
            value = models.build(model, dtype).apply({"params": in_float64(tree) if dtype == jnp.float64 else tree},
                                                     jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:]))
            assert value.dtype == dtype  # the float64 loss is float64 throughout
            return float(value)

    # the run's first loss no farther from the model's loss in float64 than the model's fp32 loss is
    assert_loss_no_farther(loss(jnp.float64), loss(jnp.float32), log["steps"][0]["loss"], terms=batch[:, 1:].size)
    meta = read_meta(str(tmp_path / "run" / "3"))
    assert meta["base"] == read_meta(out["path"])["base"] and sorted(meta["items"]["params"]) == sorted(
        read_meta(out["path"])["items"]["params"])
    moved = read_params(str(tmp_path / "run" / "3"))
    assert np.abs(moved["blocks/q_lora/b"] - flat["blocks/q_lora/b"]).max() > 1e-4


def test_bad_input_is_refused_in_one_line(base, tmp_path, capsys):
    hf_dir, base_dir, _ = base
    assert "holds no LoRA adapters" in refused(capsys, base_dir, tmp_path / "a", "--to", "peft")
    path, _, _ = lora_checkpoint(base, tmp_path / "lora", ("q", "v"), "full")
    assert "add --merge" in refused(capsys, path, tmp_path / "b", "--to", "hf")
    assert not os.path.exists(tmp_path / "b" / "model.safetensors")
    convert_ok(capsys, path, tmp_path / "adapter", "--to", "peft")
    assert "give --base" in refused(capsys, tmp_path / "adapter", tmp_path / "c")
    for key, value, named in (("use_dora", True, "use_dora=True"), ("use_rslora", True, "use_rslora=True"),
                              ("target_modules", ["q_proj", "lm_head"], "target_modules lm_head")):
        shutil.copytree(tmp_path / "adapter", tmp_path / key)
        config = json.loads((tmp_path / key / "adapter_config.json").read_text())
        (tmp_path / key / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        assert named in refused(capsys, tmp_path / key, tmp_path / "d", "--base", base_dir)
        assert not os.path.exists(tmp_path / "d")


def test_gpt2_adapters_are_refused_for_peft_but_merge(tmp_path, capsys):
    model = ModelConfig.named("gpt2-tiny").replace(n_layers=2, lora_rank=2, lora_targets=("q", "o"))
    tree = models.build(model).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    path = write_checkpoint(tmp_path / "lora", model, traverse_util.flatten_dict(tree, sep="/"))
    assert "only llama adapters map onto PEFT" in refused(capsys, path, tmp_path / "adapter", "--to", "peft")
    assert convert_ok(capsys, path, tmp_path / "merged", "--to", "hf", "--merge")["model"]["lora_rank"] == 0


def test_a_changed_base_is_refused_naming_both_digests(base, tmp_path, capsys):
    _, base_dir, params = base
    shutil.copytree(base_dir, tmp_path / "base")
    lora_base = (base[0], str(tmp_path / "base"), params)
    path, model, _ = lora_checkpoint(lora_base, tmp_path / "lora", ("q", "v"), "base")
    was = read_meta(path)["base"]["digest"]
    changed = {**params, "blocks/q/kernel": params["blocks/q/kernel"] + 1.0}  # one leaf's chunks rewritten
    new = write_checkpoint(tmp_path / "new-base", without_lora(model), changed)
    shutil.rmtree(tmp_path / "base" / "0")
    os.rename(new, tmp_path / "base" / "0")
    for argv in (("--to", "peft"), ("--to", "hf", "--merge")):
        err = refused(capsys, path, tmp_path / f"out{len(argv)}", *argv)
        assert "changed since" in err and was in err and base_ref(str(tmp_path / "base"))["digest"] in err, err
