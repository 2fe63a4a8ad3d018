"""`zinfjax bench versus-deepspeed` without DeepSpeed runs the zinfjax side and says what it skipped.

DeepSpeed is made unavailable the way a missing install is: a ``deepspeed`` package first on
PYTHONPATH whose import raises ``ModuleNotFoundError("No module named 'deepspeed'")``. The
benchmark itself (real `zinfjax train` children, real disk) runs on gpt2-tiny for two steps.
"""

import json
import os
import subprocess
import sys

from zinfjax.benchmarks.children import one_device_env
from zinfjax.benchmarks.deepspeed_step import ds_config
from zinfjax.benchmarks.versus_deepspeed import best_nvme, ratios

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hidden_deepspeed(tmp_path) -> str:
    """A directory whose ``deepspeed`` package fails to import as an absent one does."""
    package = tmp_path / "hide" / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'deepspeed'\", name='deepspeed')\n")
    return str(tmp_path / "hide")


def test_without_deepspeed_the_zinfjax_side_runs(tmp_path):
    env = one_device_env()  # one CPU device, as a user's process
    env["PYTHONPATH"] = os.pathsep.join([hidden_deepspeed(tmp_path), ROOT])
    out = subprocess.run(
        [sys.executable, "-m", "zinfjax.cli", "bench", "versus-deepspeed", "--dir", str(tmp_path / "bench"),
         "--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--warmup", "1",
         "--precision", "fp32", "--zinfjax-runs", "nvme", "--raw-bytes", "16MiB"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["deepspeed"] == {"skipped": "deepspeed is not installed (pip install -e '.[dev]')"}
    assert result["fp32"]["deepspeed"]["nvme"] == result["deepspeed"]
    assert any(s.startswith("deepspeed cpu: deepspeed is not installed") for s in result["skipped"])
    nvme = result["fp32"]["zinfjax"]["nvme"]
    assert nvme["step_s"] > 0 and len(nvme["step_times_s"]) == 2 and nvme["peak_rss_GB"] > 0.1
    assert nvme["init_s"] > nvme["setup_s"] > 0 and nvme["other_cpu_cores"] >= 0
    assert nvme["command"].startswith("zinfjax train --quiet --set model=gpt2-tiny")
    assert result["fp32"]["io_floor"]["io_floor_s"] > 0 and nvme["read_bytes_nvme"] > 0
    assert result["fp32"]["ratios"]["zinfjax_nvme_over_deepspeed_best_nvme"] is None
    assert not os.path.exists(result["nvme_dir"])  # the offloaded state is removed
    assert result["deepspeed_configs"]["fp32"]["nvme"]["optimizer"]["params"]["eps"] == 1e-8  # not rounded away


def test_ratios_take_deepspeeds_best_working_nvme_run():
    deepspeed = {"nvme": {"step_s": 6.0, "peak_rss_GB": 7.0, "init_s": 20.0},
                 "nvme_params_on_disk": {"error": "AssertionError: Not enough buffers 0 for swapping 1"},
                 "cpu": {"step_s": 5.0, "peak_rss_GB": 6.0}}
    zinfjax = {"nvme": {"step_s": 3.0, "peak_rss_GB": 3.5, "init_s": 10.0}, "host": {"step_s": 4.0, "peak_rss_GB": 3.0},
               "memory": {"step_s": 1.5, "peak_rss_GB": 2.0}}
    assert best_nvme(deepspeed)[0] == "nvme"
    r = ratios(zinfjax, deepspeed)
    assert r["zinfjax_nvme_over_deepspeed_best_nvme"] == 0.5
    assert r["zinfjax_nvme_over_deepspeed_nvme_params_on_disk"] is None
    assert r["zinfjax_nvme_over_zinfjax_memory"] == 2.0 and r["zinfjax_host_over_deepspeed_cpu"] == 0.8
    assert r["peak_rss_zinfjax_nvme_over_deepspeed_best_nvme"] == 0.5


def test_deepspeed_configs_offload_to_the_tier_asked():
    nvme = ds_config("nvme", "bf16", 4, "/mnt/nvme/x", max_in_cpu=10**6)
    zero = nvme["zero_optimization"]
    assert zero["stage"] == 3 and nvme["bf16"] == {"enabled": True}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/mnt/nvme/x",
                                     "max_in_cpu": 10**6}
    assert zero["offload_optimizer"]["device"] == "nvme" and "aio" in nvme
    cpu = ds_config("cpu", "fp32", 4)
    assert cpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert "aio" not in cpu and cpu["bf16"] == {"enabled": False}


def test_sub_group_size_reaches_every_deepspeed_run_and_auto_sets_the_budget(tmp_path):
    """``--sub-group-size`` (DeepSpeed's default of 1e9 swaps GPT-2 large's whole optimizer state in at once) goes
    into each config; the zinfjax ``auto`` run is the user's tiers=auto, with an nvme_path and the budget."""
    from zinfjax.benchmarks.versus_deepspeed import deepspeed_configs, parser, zinfjax_overrides

    args = parser().parse_args(["--dir", str(tmp_path), "--sub-group-size", "100000000", "--memory-limit", "14GiB"])
    assert {c["zero_optimization"]["sub_group_size"] for c in deepspeed_configs(args, "fp32").values()} == {10**8}
    assert "sub_group_size" not in ds_config("nvme", "fp32", 1, "/x")["zero_optimization"]
    auto = zinfjax_overrides(args, "auto", "fp32", "log.json")
    assert f"memory_limit={14 << 30}" in auto and any(o.startswith("nvme_path=") for o in auto)
    assert not any(o.split("=")[0] in ("params", "optimizer", "gradients", "activations") for o in auto)
    assert "auto" not in parser().parse_args(["--dir", str(tmp_path)]).zinfjax_runs  # not a default run
