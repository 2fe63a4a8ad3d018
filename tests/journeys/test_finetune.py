"""Fine-tuning a Hugging Face model, as docs/interop.md and docs/data.md walk it.

A tiny HF Llama (random weights) and its byte-level BPE, saved with ``save_pretrained``; ``zinfjax convert``;
``zinfjax train`` on a text file with nothing but ``nvme_path`` for placement (``tiers=auto``, the default);
``zinfjax evaluate`` and ``zinfjax generate`` on text; LoRA on the converted model; ``--to peft`` loaded by peft and
``--to hf --merge`` loaded by transformers with its tokenizer. The greedy tokens of ``zinfjax generate`` are those
that transformers and peft generate from the exported models.
"""

import json
import math
import os
import re

import pytest

from tests.support.commands import ok, sets, trained
from tests.support.hf_text import TEXT, converted_llama, greedy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()
# peft 0.21 asks transformers 5 for a property it deprecated
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
PROMPT = "Line 7: the layer streams from disk"
EVALUATED = re.compile(r"loss (\S+), perplexity (\S+) over (\d+) tokens")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``zinfjax convert HF_DIR OUT`` of the HF Llama: (root, the HF directory, OUT, the HF tokenizer); the user's
    notes.txt beside them."""
    root = tmp_path_factory.mktemp("finetune")
    base, tok = converted_llama(root)
    (root / "notes.txt").write_text(TEXT)
    return root, root / "llama", base, tok


def train(converted, name: str, *settings) -> tuple[str, str]:
    """``zinfjax train --set model=OUT --set data=notes.txt --set nvme_path=... --set steps=2 --set save_dir=...``:
    nothing but nvme_path for placement."""
    root, _, base, _ = converted
    return ok("train", *sets(f"model={base}", f"data={root / 'notes.txt'}", f"nvme_path={root / name}-nvme",
                             "steps=2", f"save_dir={root / name}", *settings))


@pytest.fixture(scope="module")
def finetuned(converted):
    """The full fine-tune: (its save_dir, stdout, stderr)."""
    out, err = train(converted, "run")
    return converted[0] / "run", out, err


@pytest.fixture(scope="module")
def adapted(converted):
    """The LoRA run (``--set lora_rank=4 --set lora_targets=q,v``): (its save_dir, stdout). Its placement is planned
    without the timing probes (``ZINFJAX_PLAN_PROBE=0``, docs/config.md): the full fine-tune walked them already."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZINFJAX_PLAN_PROBE", "0")
        out, _ = train(converted, "lora", "lora_rank=4", "lora_targets=q,v")
    return converted[0] / "lora", out


def generated(checkpoint, *flags) -> list[int]:
    """``zinfjax generate CHECKPOINT --prompt PROMPT --json``: the one sequence's ids, prompt and new tokens."""
    out, _ = ok("generate", checkpoint, "--prompt", PROMPT, "--json", *flags)
    (tokens,) = json.loads(out)["tokens"]
    return tokens


def evaluated(checkpoint, notes) -> tuple[float, float, int]:
    """``zinfjax evaluate CHECKPOINT --data notes.txt --batches 1``: (loss, perplexity, tokens) as printed."""
    out, _ = ok("evaluate", checkpoint, "--data", notes, "--batches", "1")
    found = EVALUATED.search(out)
    assert found, out
    return float(found[1]), float(found[2]), int(found[3])


def test_convert_keeps_the_tokenizer_and_train_takes_the_plans_placement(converted, finetuned):
    root, _, base, _ = converted
    run, out, err = finetuned
    assert (base / "0" / "zinfjax.json").is_file() and (base / "tokenizer" / "tokenizer.json").is_file()
    trained(out, 2)
    assert re.search(r"tiers=auto: params=\S+ optimizer=\S+ gradients=\S+ activations=\S+", err), err
    assert (run / "2" / "zinfjax.json").is_file()
    # the run keeps the tokenizer it was trained with, so that its checkpoints are read as text by it
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (base / "tokenizer" / "tokenizer.json").read_bytes()


def test_the_fine_tune_evaluates_and_generates_text_as_transformers_does(converted, finetuned, tmp_path):
    root, _, _, tok = converted
    run = finetuned[0]
    loss, perplexity, tokens = evaluated(run, root / "notes.txt")
    assert tokens == 8 * 64 and perplexity == pytest.approx(math.exp(loss), rel=1e-3)  # batch_size x seq_len
    tokens = generated(run)
    ids = tok(PROMPT)["input_ids"]
    assert tokens[:len(ids)] == ids and len(tokens) == len(ids) + 32  # --max-new-tokens: 32
    ok("convert", run, tmp_path / "hf", "--to", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(PROMPT)["input_ids"] == ids
    assert greedy(model, ids, 32) == tokens


def test_lora_on_the_converted_model_evaluates_and_generates_text(converted, adapted):
    root, _, base, _ = converted
    lora, out = adapted
    trained(out, 2)
    info, _ = ok("ckpt", "info", lora)
    leaves = re.findall(r"^  (blocks\.\S+|embed\S*|head\S*) ", info.split("opt_state:")[0], flags=re.M)
    assert leaves and all("_lora." in leaf for leaf in leaves), info  # the adapters alone: the base is named
    assert not (lora / "tokenizer").exists()  # found beside the base it names
    loss, perplexity, _ = evaluated(lora, root / "notes.txt")
    assert math.isfinite(loss) and perplexity == pytest.approx(math.exp(loss), rel=1e-3)
    text, _ = ok("generate", lora, "--prompt", PROMPT, "--max-new-tokens", "8")
    assert text.startswith(PROMPT), text


def test_the_adapters_export_to_peft_and_merged_to_hf_as_zinfjax_generates(converted, adapted, tmp_path):
    _, hf, _, tok = converted
    lora = adapted[0]
    tokens = generated(lora)
    ids = tok(PROMPT)["input_ids"]
    ok("convert", lora, tmp_path / "adapter", "--to", "peft")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    adapter = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf),
                                             tmp_path / "adapter")
    assert greedy(adapter, ids, 32) == tokens
    ok("convert", lora, tmp_path / "merged", "--to", "hf", "--merge")
    merged_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged_tok(PROMPT)["input_ids"] == ids and merged_tok.decode(tokens[:len(ids)]) == PROMPT
    assert greedy(merged, ids, 32) == tokens
