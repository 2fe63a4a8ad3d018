"""Planning, as README.md and docs/planning.md walk it: ``zinfjax plan --machine`` for each machine of
examples/machines/ and each model of examples/models/ at ZeRO-3, README's own plan of the 1T model on DGX-2 nodes,
then ``zinfjax train`` of gpt2-tiny with the placement a plan prints (its first fitting row's tier keys)."""

import json
import pathlib
import re

import pytest

from tests.support.commands import ok, sets, trained

ROOT = pathlib.Path(__file__).resolve().parents[2]
MACHINES = sorted((ROOT / "examples" / "machines").glob("*.yaml"))
MODELS = sorted((ROOT / "examples" / "models").glob("*.yaml"))
TIERS = ("params", "optimizer", "gradients", "activations")
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(yes|no)\s")


def first_fitting(out: str) -> dict[str, str]:
    """The tier keys of the first row that fits in the table of placements ``zinfjax plan --machine`` prints."""
    _, found, table = out.partition("\nplacements on ")
    assert found, f"no table of placements in: {out}"
    header, *rows = table.split("\n\n")[0].splitlines()[1:]
    assert header.split()[:5] == [*TIERS, "fits"], header
    fitting = [m.groups()[:4] for m in map(ROW.match, rows) if m and m[5] == "yes"]
    assert fitting, table
    return dict(zip(TIERS, fitting[0], strict=True))


@pytest.fixture(scope="module")
def plans() -> dict[tuple[str, str], str]:
    """``zinfjax plan --machine M --set model=X --set stage=3 --set precision=bf16`` of every example machine and
    model: (machine, model) -> what it printed."""
    return {(machine.stem, model.stem): ok("plan", "--machine", machine, *sets(f"model={model}", "stage=3",
                                                                                "precision=bf16"))[0]
            for machine in MACHINES for model in MODELS}


def test_every_example_machine_plans_every_example_model(plans):
    assert len(MACHINES) >= 3 and len(MODELS) >= 6
    for (machine, model), out in plans.items():
        recommended = re.search(r"^recommended: (params=\S+ optimizer=\S+ gradients=\S+ activations=\S+) ", out,
                                flags=re.M)
        assert recommended and f"model {ROOT / 'examples' / 'models' / model}.yaml" in out, (machine, model)
        assert recommended[1] == " ".join(f"{k}={v}" for k, v in first_fitting(out).items()), (machine, model)


def test_the_readmes_plan_holds_the_1t_model_on_one_dgx2_only_with_nvme():
    out, _ = ok("plan", "--machine", "examples/machines/dgx2-v100.yaml",
                *sets("model=examples/models/zero-infinity-1t.yaml", "precision=fp16", "stage=3",
                      "micro_batch_size=2", "batch_size=0", "seq_len=1024"))
    assert re.search(r"^  GPU\+CPU\+NVMe \(ZeRO-Infinity\)\s+1\s", out, flags=re.M), out
    assert first_fitting(out) == {"params": "nvme", "optimizer": "nvme", "gradients": "nvme", "activations": "device"}


@pytest.mark.parametrize("machine", ["dgx2-v100", "tpu-v5e-host"])
def test_train_takes_the_placement_the_plan_prints(plans, machine, tmp_path):
    """The 1T model's first fitting placement on the machine, given to a tiny run as its tier keys."""
    placement = first_fitting(plans[(machine, "zero-infinity-1t")])
    log = tmp_path / "log.json"
    out, _ = ok("train", *sets(*(f"{k}={v}" for k, v in placement.items()), f"nvme_path={tmp_path / 'nvme'}",
                               "model=gpt2-tiny", "steps=2", "seq_len=32", f"log={log}"))
    trained(out, 2)
    config = json.loads(log.read_text())["config"]
    assert {k: config[k] for k in TIERS} == placement


def test_tiers_auto_trains_the_demo_with_the_placement_it_prints(tmp_path, monkeypatch):
    """``zinfjax train examples/demo.yaml --set tiers=auto --set nvme_path=...``: the plan's pick replaces the demo's
    tier keys, and the run says which it took. Planned without the timing probes (``ZINFJAX_PLAN_PROBE=0``,
    docs/config.md): tests/journeys/test_finetune.py walks them."""
    monkeypatch.setenv("ZINFJAX_PLAN_PROBE", "0")
    log = tmp_path / "log.json"
    out, err = ok("train", ROOT / "examples" / "demo.yaml", *sets("tiers=auto", f"nvme_path={tmp_path / 'nvme'}",
                                                                   "model=gpt2-tiny", "steps=2", "seq_len=32",
                                                                   f"log={log}"))
    trained(out, 2)
    said = re.search(r"tiers=auto: params=(\S+) optimizer=(\S+) gradients=(\S+) activations=(\S+) ", err)
    config = json.loads(log.read_text())["config"]
    assert said and [config[k] for k in TIERS] == list(said.groups()) and config["tiers"] == "manual", err
