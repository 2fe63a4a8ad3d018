"""`zinfjax plan --machine`: the ZeRO-Infinity paper's models on its DGX-2, from the shipped files, and bad input.

Nothing is traced: the trillion-parameter figures come from the ModelConfig shapes alone.
"""

import json
import math
import pathlib

import jax
import pytest

from zinfjax import models
from zinfjax.cli import main
from zinfjax.config import Config
from zinfjax.errors import ConfigError
from zinfjax.models import ModelConfig
from zinfjax.models.stacked import lm_init
from zinfjax.planning.machine import load_machine
from zinfjax.planning.machine_plan import WORKING_FRACTION, plan_for_machine
from zinfjax.planning.recommend import PlanError
from zinfjax.planning.scale import largest_unit, paper_working_memory, parameter_count, units

ROOT = pathlib.Path(__file__).resolve().parents[2]
DGX2 = str(ROOT / "examples" / "machines" / "dgx2-v100.yaml")
GiB = 2**30
# The paper's rows: (file, parameters in trillions as the paper labels them, layers, hidden, heads, the paper's
# model-state working memory per GPU in GB (GiB: 4 x hidden x 4 hidden bytes)).
ROWS = [("0.1t", 0.10, 80, 10240, 128, 1.95), ("0.5t", 0.50, 100, 20480, 160, 6.25),
        ("1t", 1.01, 128, 25600, 256, 9.77), ("10t", 10.05, 195, 65536, 512, 64.00),
        ("100t", 101.47, 315, 163840, 1024, 400.00)]


def _model(row: str) -> str:
    return str(ROOT / "examples" / "models" / f"zero-infinity-{row}.yaml")


# fp16, ZeRO-3, 2 sequences of 1024 tokens a GPU (32 a DGX-2 node: the batch the paper's activation
# checkpoints per node imply, 0.76 TB for the 10T row), as docs/BENCHMARKS.md, "On paper", runs them.
PAPER = ["precision=fp16", "stage=3", "micro_batch_size=2", "batch_size=0", "seq_len=1024"]


def _config(row: str, *extra) -> Config:
    return Config.load(None, [f"model={_model(row)}", *PAPER, *extra])


def _args(row: str) -> list[str]:
    return [a for s in (f"model={_model(row)}", *PAPER) for a in ("--set", s)]


@pytest.mark.parametrize("row, trillions, layers, hidden, heads, mswm_gb", ROWS)
def test_the_paper_rows_shapes_and_working_memory(row, trillions, layers, hidden, heads, mswm_gb):
    m = ModelConfig.resolve(_model(row))
    assert (m.n_layers, m.d_model, m.n_heads, m.d_ff) == (layers, hidden, heads, 4 * hidden)
    blocks = 12 * layers * hidden**2  # the paper's count: 12 x nl x hd^2
    assert round(blocks / 1e12, 2) == trillions
    assert blocks < parameter_count(m) < 1.006 * blocks  # biases, norms, the vocabulary and positions
    # the paper's working memory: fp16 parameters and gradients (2 + 2 bytes) of the hidden x 4 hidden matrix
    assert paper_working_memory(m, "fp16") == 4 * hidden * 4 * hidden
    if row != "0.1t":  # 4 x 10240 x 40960 is 1.5625 GiB, not the 1.95 quoted for this row (docs/BENCHMARKS.md)
        assert round(paper_working_memory(m, "fp16") / GiB, 2) == mswm_gb


def test_1t_untiled_working_memory_is_the_shapes_arithmetic():
    m = ModelConfig.resolve(_model("1t"))
    assert m.d_model * m.d_ff == 2_621_440_000  # 2.62e9 parameters in one d x 4d matrix
    assert paper_working_memory(m, "fp16") == 2_621_440_000 * 4 == 10_485_760_000
    assert round(paper_working_memory(m, "fp16") / GiB, 2) == 9.77
    plan = plan_for_machine(_config("1t"), load_machine(DGX2))
    w = plan["working"]
    assert w["paper"] == 10_485_760_000
    # zinfjax's untiled unit is the whole MLP: W_in and W_out with their biases, 2 x 2.62e9 + d_ff parameters
    assert w["untiled"]["unit"] == "mlp tile" and w["untiled"]["params"] == 2 * 2_621_440_000 + 102_400
    tile = units(m, 1, w["samples_per_device"], 1024)[0]
    assert w["untiled"]["bytes"] == 2 * (2 * tile.params + tile.activations)


def test_dgx2_holds_1t_on_one_node_only_with_nvme():
    plan = plan_for_machine(_config("1t"), load_machine(DGX2))
    classes = {c["class"]: c for c in plan["classes"]}
    assert classes["GPU+CPU+NVMe (ZeRO-Infinity)"]["nodes"] == 1
    assert classes["GPU+CPU (ZeRO-Offload)"]["nodes"] > 1 and classes["GPU only (ZeRO-3)"]["nodes"] > 1
    assert plan["nodes"] == 1
    fitting = [r for r in plan["placements"] if r["fits"]]
    assert fitting and all("nvme" in r["tiers"].values() for r in fitting)
    # 16 bytes a parameter (fp16 params and gradients, fp32 master and Adam moments) do not fit 1.5 TiB of host
    state = sum(plan["state"][k]["whole"] for k in ("params", "grads", "master", "opt"))
    assert state == 16 * plan["parameters"]
    assert plan["state"]["params"]["per_device"] == plan["state"]["params"]["whole"] / 16
    assert plan["recommended"]["step_s"] > 0 and 0 < plan["recommended"]["peak_fraction"] <= 0.4


@pytest.mark.parametrize("row, nodes, tiles", [("10t", 6, 16), ("100t", 60, 64)])
def test_10t_and_100t_nodes_and_tiles_on_dgx2(row, nodes, tiles):
    machine = load_machine(DGX2)
    plan = plan_for_machine(_config(row), machine)
    infinity = next(c for c in plan["classes"] if c["class"] == "GPU+CPU+NVMe (ZeRO-Infinity)")
    assert plan["nodes"] == infinity["nodes"] == nodes
    assert plan["batch_size"] == 32 * nodes and plan["state"]["acts"]["per_node"] == 32 * 1024 * plan[
        "model_config"]["d_model"] * plan["model_config"]["n_layers"] * 2
    if row == "10t":  # the paper's 0.76 TB of activation checkpoints a node (in TiB: 2 x 32 x 1024 x 64K x 195)
        assert round(plan["state"]["acts"]["per_node"] / 2**40, 2) == 0.76
    # the state, most of it on NVMe, needs that many nodes' drives and no fewer
    state = sum(plan["state"][k]["whole"] for k in ("params", "grads", "master", "opt"))
    assert state <= nodes * (machine.nvme_capacity + machine.host_memory + 16 * machine.device_memory)
    with pytest.raises(PlanError, match=f"fits no placement on {nodes - 1} node"):
        plan_for_machine(_config(row), machine, nodes=nodes - 1)
    w = plan["working"]
    assert w["tiles"] == tiles
    assert w["untiled"]["bytes"] > machine.device_memory  # untiled, the MLP's parameters alone exceed a V100
    assert w["tiled"]["bytes"] <= WORKING_FRACTION * machine.device_memory  # tiled, half a V100 holds it
    m = ModelConfig.resolve(_model(row))
    smaller = tiles // 2  # the next tile count down does not fit: tiles is the fewest
    assert largest_unit(m, smaller, w["samples_per_device"], 1024, "fp16")[1] > WORKING_FRACTION * machine.device_memory


def traced_parameter_count(m: ModelConfig) -> int:
    """The leaves the model declares, from ``jax.eval_shape`` of its initialiser."""
    abstract = jax.eval_shape(lm_init(models.build(m)), jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def test_parameter_counts_are_the_models_own():
    """With LoRA adapters too (the count `zinfjax plan` reports for a model that has them), and with heads that do
    not divide d_model (q, k, v as wide as the heads, not as d_model)."""
    for m in (ModelConfig.named("gpt2-tiny"), ModelConfig.named("llama-tiny"),
              ModelConfig("bert", 1000, 64, 64, 2, 4, 256), ModelConfig("llama", 1000, 64, 64, 2, 8, 160, 2, True),
              ModelConfig.named("gpt2-tiny").replace(lora_rank=4),
              ModelConfig.named("llama-tiny").replace(lora_rank=4, lora_targets=("q", "k", "v", "o", "gate", "up",
                                                                                 "down")),
              ModelConfig("gpt2", 300, 32, 96, 2, 5, 200), ModelConfig("llama", 300, 32, 100, 2, 6, 200, 2)):
        assert parameter_count(m) == traced_parameter_count(m)


def test_table_and_json(capsys):
    assert main(["plan", "--machine", DGX2, *_args("1t")]) == 0
    out = capsys.readouterr().out
    assert "GPU+CPU+NVMe (ZeRO-Infinity)" in out and "tiles=2" in out and "9.8 GiB" in out
    assert main(["plan", "--machine", str(ROOT / "examples/machines/h100-8x.yaml"), "--json", "--set",
                 "model=gpt2-small", "--set", "precision=bf16", "--set", "stage=3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["nodes"] == 1 and plan["recommended"]["tiers"]["params"] == "device"
    assert plan["machine"]["sources"]["node.host_memory"].startswith("2 TB")


def test_each_class_shows_the_placement_it_names_where_the_devices_hold_everything(capsys):
    """llama-7b in bf16 at stage 3 fits the devices of one DGX H100 node. The ZeRO-Offload row still shows ZeRO-Offload
    (the optimizer on the host, nothing on NVMe) at its own predicted step, and ZeRO-Infinity's the optimizer off the
    devices and it or the parameters on NVMe: not the devices-only placement of the row above, three times over."""
    h100 = str(ROOT / "examples/machines/h100-8x.yaml")
    sets = ["model=llama-7b", "precision=bf16", "stage=3"]
    plan = plan_for_machine(Config.load(None, sets), load_machine(h100))
    gpu, offload, infinity = (c["tiers"] for c in plan["classes"])
    assert set(gpu.values()) == {"device"}
    assert offload["optimizer"] == "host" and "nvme" not in offload.values()
    assert infinity["optimizer"] != "device" and "nvme" in (infinity["params"], infinity["optimizer"])
    steps = [c["step_s"] for c in plan["classes"]]
    assert steps[0] < steps[1] and steps[0] < steps[2]
    assert main(["plan", "--machine", h100, *[a for s in sets for a in ("--set", s)]]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "(ZeRO-" in line]
    assert len(rows) == 3 and "optimizer=host" in rows[1] and "nvme" in rows[2], rows


def test_tpu_host_without_nvme_plans_device_and_host_only():
    plan = plan_for_machine(Config.load(None, ["model=llama-1b", "precision=bf16", "stage=3"]),
                            load_machine(str(ROOT / "examples/machines/tpu-v5e-host.yaml")))
    assert len(plan["placements"]) == 16 and not any("nvme" in r["tiers"].values() for r in plan["placements"])


# ---- bad input: one line, naming what is wrong ----------------------------------------------------


def _machine_file(tmp_path, **changes) -> str:
    text = pathlib.Path(DGX2).read_text()
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "machine.yaml"
    path.write_text(text)
    return str(path)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zinfjax: error: "), err
    return err[0]


@pytest.mark.parametrize("old, new, says", [
    ("    memory: 32GiB\n", "", "node.device.memory is missing"),
    ("host_memory: 1.5TiB", "host_memory: -1", "node.host_memory=-1 must be"),
    ("host_memory: 1.5TiB", "host_memory: lots", "node.host_memory='lots' is not a byte size"),
    ("peak_flops: 125e12", "peak_flops: fast", "node.device.peak_flops='fast' is not a number"),
    ("nvme_read_GBps: 24", "nvme_read_GBps: -24", "node.nvme_read_GBps=-24 must be 0 or more"),
    ("matmul_efficiency: 0.40", "matmul_efficiency: 1.5", "node.matmul_efficiency=1.5 must be above 0 and at most 1"),
    ("  devices: 16", "  devices: 2.5", "node.devices=2.5 must be a whole number"),
    ("  devices: 16", "  devices: 16\n  device_count: 16", "unknown key node.device_count"),
    ("  nvme_read_GBps: 24\n", "", "node.nvme_read_GBps is missing: GB/s the node's NVMe drives read together"),
    ("  nvme_write_GBps: 12\n", "", "node.nvme_write_GBps is missing: GB/s the node's NVMe drives write together"),
    ("nvme_read_GBps: 24", "nvme_read_GBps: 0", "node.nvme_read_GBps must be above 0 when node.nvme_capacity is above"),
])
def test_bad_machine_files_name_the_field(capsys, tmp_path, old, new, says):
    err = _one_line_error(capsys, ["plan", "--machine", _machine_file(tmp_path, **{old: new}), *_args("1t")])
    assert says in err and "machine file" in err


def test_a_model_that_fits_nowhere_says_what_is_short_and_by_how_much(capsys, tmp_path):
    err = _one_line_error(capsys, ["plan", "--machine", DGX2, "--nodes", "1", *_args("10t")])
    assert "fits no placement on 1 node(s)" in err
    assert "NVMe per node is short by" in err and "has 27.9 TiB" in err and "it fits on 6 nodes" in err
    limited = _machine_file(tmp_path, **{"name: DGX-2": "nodes: 2\nname: DGX-2"})
    err = _one_line_error(capsys, ["plan", "--machine", limited, *_args("10t")])
    assert "fits no placement on 2 node(s)" in err and "NVMe per node is short by" in err
    with pytest.raises(PlanError, match=r"needs .* has 27\.9 TiB"):
        plan_for_machine(_config("100t"), load_machine(DGX2), nodes=32)


def test_bad_plan_arguments(capsys):
    assert "--nodes 2: give it with --machine FILE" in _one_line_error(capsys, ["plan", "--nodes", "2"])
    assert "--nodes 0: must be 1 or more" in _one_line_error(capsys, ["plan", "--machine", DGX2, "--nodes", "0"])
    assert "machine file 'nowhere.yaml' does not exist" in _one_line_error(capsys, ["plan", "--machine",
                                                                                   "nowhere.yaml"])
    with pytest.raises(ConfigError, match="seq_len=2048 exceeds the model's context of 1024"):
        plan_for_machine(_config("1t", "seq_len=2048"), load_machine(DGX2))
