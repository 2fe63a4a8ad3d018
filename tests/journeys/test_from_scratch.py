"""From scratch, as README.md's "On the command line" walks it: the demo config (`make demo`'s run), checkpoints,
a resume at ZeRO-3, ``zinfjax ckpt info`` and ``--verify``, then ``zinfjax generate`` and ``zinfjax evaluate`` with
the parameters streamed from NVMe.

The demo's own settings stay (parameters, optimizer state and activations on NVMe, prefetch, the demo corpus);
``--set`` makes it small (llama-tiny, 2 steps of 8 x 32 tokens) and puts its files under the test's directory.
"""

import json
import math
import pathlib
import re

import pytest

from tests.support.commands import ok, sets, trained

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "demo.yaml")


def demo_settings(root, steps: int) -> list[str]:
    """The demo made small, its files under ``root``."""
    return sets("model=llama-tiny", f"steps={steps}", "seq_len=32", f"nvme_path={root / 'nvme'}",
                f"log={root / f'log-{steps}.json'}")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``zinfjax train examples/demo.yaml --set save_dir=... --set save_every=20`` for 2 steps, then ``--set
    resume=true --set stage=3 --set mesh=data:4,model:2`` (ZeRO-3 and tensor parallel) to step 4: (root, save_dir,
    the two runs' stdout)."""
    root = tmp_path_factory.mktemp("demo")
    save_dir = root / "ckpt"
    first, _ = ok("train", DEMO, *sets(f"save_dir={save_dir}", "save_every=20"), *demo_settings(root, 2))
    resumed, _ = ok("train", DEMO, *sets(f"save_dir={save_dir}", "resume=true", "stage=3", "mesh=data:4,model:2"),
                    *demo_settings(root, 4))
    return root, save_dir, (first, resumed)


def test_the_demo_trains_on_nvme_and_resumes_at_stage_3_tensor_parallel(demo_run):
    # what `make demo` runs is the command given examples/demo.yaml here
    recipe = re.search(r"^demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert recipe and recipe[1].strip() == "$(VENV)/bin/zinfjax train examples/demo.yaml"
    root, save_dir, (first, resumed) = demo_run
    trained(first, 2)
    trained(resumed, 2)
    log = json.loads((root / "log-2.json").read_text())
    assert [s["step"] for s in log["steps"]] == [1, 2] and (root / "log-2.png").is_file()  # the loss curve
    assert log["steps"][-1]["read_bytes_nvme"] > 0 and any((root / "nvme").iterdir())
    log = json.loads((root / "log-4.json").read_text())
    assert [s["step"] for s in log["steps"]] == [3, 4]
    assert (log["config"]["stage"], log["config"]["mesh"]) == (3, "data:4,model:2")
    assert sorted(p.name for p in save_dir.iterdir() if p.name.isdigit()) == ["2", "4"]


def test_ckpt_info_and_verify_name_both_checkpoints(demo_run):
    _, save_dir, _ = demo_run
    info, _ = ok("ckpt", "info", save_dir)
    assert re.search(r"^steps: 2, 4$", info, flags=re.M) and "llama" in info, info
    verified, _ = ok("ckpt", "info", save_dir, "--verify")
    assert verified.splitlines() == ["step 2: complete", "step 4: complete",
                                     "2 of 2 complete; the newest complete is step 4"], verified


def nvme(root, name: str) -> list[str]:
    return sets("params=nvme", f"nvme_path={root / name}")


def test_generate_streams_the_parameters_from_nvme(demo_run):
    root, save_dir, _ = demo_run
    text, _ = ok("generate", save_dir, "--prompt", "The ", *nvme(root, "gen"))
    assert text.startswith("The ") and len(text) > len("The ") + 1, text
    text, _ = ok("generate", save_dir, "--prompt", "The ", "--max-new-tokens", "40", *nvme(root, "gen"))
    assert text.startswith("The ") and len(text.encode()) >= len("The ") + 40, text  # bytes: a token each
    flags = ["--prompt-ids", "1,2,3", "--batch-size", "64", "--json", "--temperature", "0.8", "--top-k", "50",
             "--top-p", "0.95", "--seed", "1", *nvme(root, "gen"), *sets("kv_cache=host")]
    sampled = json.loads(ok("generate", save_dir, *flags)[0])["tokens"]
    assert len(sampled) == 64 and all(row[:3] == [1, 2, 3] and len(row) == 3 + 32 for row in sampled)
    assert len({tuple(row) for row in sampled}) > 1  # sampled, not greedy: the rows differ
    assert json.loads(ok("generate", save_dir, *flags)[0])["tokens"] == sampled  # seeded


def test_evaluate_streams_the_parameters_from_nvme(demo_run):
    root, save_dir, _ = demo_run
    out, _ = ok("evaluate", save_dir, "--data", "demo", *nvme(root, "eval"))
    loss, perplexity = map(float, re.search(r"loss (\S+), perplexity (\S+) over", out).groups())
    assert 0 < loss < math.log(256) + 1 and perplexity == pytest.approx(math.exp(loss), rel=1e-3)
