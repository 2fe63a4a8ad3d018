"""Every script in examples/ runs to the end for 2 steps (the smallest size), and its loss is finite."""

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.support.xla_flags import child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# script -> its options for a short run (None: the script takes none; it runs its own 20 steps of gpt2-tiny)
ARGS = {
    "train_linen.py": None,
    "train_nnx.py": None,
    "bert_mlm_linen.py": ["--steps", "2", "--batch-size", "2", "--nvme-path", "{tmp}/nvme"],
    "llama_nnx.py": ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--nvme-path", "{tmp}/nvme"],
    "lora_nnx.py": ["--steps", "2", "--nvme-path", "{tmp}/nvme"],
    "vit_linen.py": ["--steps", "2", "--size", "tiny", "--batch-size", "2", "--nvme-path", "{tmp}/nvme"],
}
# The ViT and BERT scripts are wide (make test-all): make test trains the same models with dropout, a mask and
# stage 3 in tests/test_any_model.py, and runs the other examples here.
WIDE = {"bert_mlm_linen.py", "vit_linen.py"}
# Run for real elsewhere, with more to check than a finite loss.
ELSEWHERE = {"finetune_hf.py": "tests/interop/test_convert.py::"
                               "test_the_example_fine_tunes_a_converted_model_and_transformers_scores_it_better"}


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([*ARGS, *ELSEWHERE])
    for script, test in ELSEWHERE.items():
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text() and script in (ROOT / path).read_text()


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.wide) if s in WIDE else s for s in ARGS])
def test_example_runs_with_a_finite_loss(script, tmp_path):
    args = [a.format(tmp=tmp_path) for a in ARGS[script] or []]
    # One CPU device, as a user's process, compiled as the tests compile (tests.support.xla_flags): the test asks
    # that the script runs to the end with a finite loss, which XLA's optimisation level does not change, and
    # compiling each example's functions at XLA's default level was most of what these five runs cost.
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss:? (\S+?)(?:,|\s|$)", out.stdout)]
    assert losses and all(math.isfinite(x) for x in losses), out.stdout[-2000:]
