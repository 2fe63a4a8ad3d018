"""A DeepSpeed user's path, as README.md and docs/interop.md walk it: a ZeRO-3 run saved by DeepSpeed itself (two
ranks on the CPU, tests/support/deepspeed_child.py) beside its ds_config.json; ``zinfjax convert`` of the run;
``zinfjax train ds_config.json`` resuming from the converted checkpoint on the user's nanoGPT-style ``.bin`` tokens;
``zinfjax convert --to hf`` loaded by transformers, which generates the tokens ``zinfjax generate`` does.

DeepSpeed's run (one ZeRO-3 run of two ranks) takes 8 to 17 s on 2 CPU cores, as busy as they are.
"""

import json
import os

import numpy as np
import pytest

from tests.support import deepspeed_child as child
from tests.support.commands import ok, sets, trained
from tests.support.hf_text import greedy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import safetensors.numpy  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

RUN = "zero3-fp32"
PROMPT = [5, 17, 42, 8, 3, 61]


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    """DeepSpeed's ZeRO-3 fp32 run at step 3 (``latest``, ``global_step3/``, config.json, ds_config.json), and the
    user's training tokens: ids below the model's vocabulary of 97, as nanoGPT's uint16 .bin."""
    root = tmp_path_factory.mktemp("deepspeed-user")
    child.launch(root, [f"{RUN}:3:fp32"])
    tokens = np.random.default_rng(0).integers(0, child.model_config().vocab_size, 4096, dtype=np.uint16)
    tokens.tofile(root / "train.bin")
    return root, root / RUN


def test_a_deepspeed_run_converts_trains_on_and_exports_to_transformers(deepspeed_run, tmp_path):
    root, ds = deepspeed_run
    converted = tmp_path / "from-ds"
    out, _ = ok("convert", ds, converted)
    assert "(deepspeed) to zinfjax" in out and (converted / "3" / "zinfjax.json").is_file(), out
    ok("convert", converted, tmp_path / "at-step-3", "--to", "hf")  # DeepSpeed's own fp32 weights, moved
    reference = torch.load(ds / "reference.pt", weights_only=True)["state"]
    for name, array in safetensors.numpy.load_file(tmp_path / "at-step-3" / "model.safetensors").items():
        np.testing.assert_array_equal(array, reference[name]["fp32"].numpy(), err_msg=name)
    out, _ = ok("train", ds / "ds_config.json", *sets(f"model={converted}", f"save_dir={converted}", "resume=true",
                                                      f"data={root / 'train.bin'}", "seq_len=16", "steps=5"))
    trained(out, 2)  # steps 4 and 5, after DeepSpeed's 3
    assert json.loads((converted / "5" / "zinfjax.json").read_text())["config"]["stage"] == 3  # ds_config's
    ok("convert", converted, tmp_path / "hf", "--to", "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not torch.equal(model.transformer.wte.weight, reference["transformer.wte.weight"]["fp32"])  # trained on
    generated, _ = ok("generate", converted, "--prompt-ids", ",".join(map(str, PROMPT)), "--json",
                      "--max-new-tokens", "12")
    assert json.loads(generated)["tokens"] == [greedy(model, PROMPT, 12)]
