"""bench/gpu.py, the accelerator benchmark: its refusal without a GPU, and its whole path on the CPU."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.xla_flags import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, tmp_path):
    env = child_env()  # one device, as a user's process has; its assertions are on bytes and placements, not speed
    return subprocess.run([sys.executable, "bench/gpu.py", "--dir", str(tmp_path / "gpu"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_asking_for_a_gpu_on_a_machine_without_one_names_the_platforms_found(tmp_path):
    out = run("--platform", "gpu", tmp_path=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("bench/gpu.py: no gpu device on this machine (platforms found: cpu); run it where "
                                  "one is, or pass --platform cpu for a dry run")


@pytest.mark.slow
def test_the_cpu_dry_run_reports_every_placement(tmp_path):
    out = run("--platform", "cpu", "--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16", "--grad-accum",
              "1", "--steps", "3", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    runs = result["runs"]
    assert set(runs) == {"host", "nvme_optimizer", "device"}
    n = result["parameters"]
    # host: bf16 params read in and out... and the fp32 master, m and v both ways: at least 24 B/param, which
    # cross the link on a GPU. On the CPU backend the host tier is device memory, so nothing crosses.
    assert runs["host"]["host_tier_bytes"] >= 24 * n
    assert runs["host"]["host_memory_kind"] == "device" and runs["host"]["host_link_bytes"] == 0
    assert runs["nvme_optimizer"]["nvme_bytes"] >= 2 * 12 * n and runs["nvme_optimizer"]["io_floor_s"] > 0
    assert runs["device"]["host_link_bytes"] == 0 and runs["device"]["over_device_step"] == 1.0
    assert runs["host"]["mfu"] is None  # the CPU has no known bf16 peak
    assert all(r["step_s"] > 0 for r in runs.values())


@pytest.mark.parametrize("placements", [("host",), pytest.param(("host", "device"), marks=pytest.mark.wide)])
def test_the_dry_run_with_the_update_on_the_host_moves_gradients_and_parameters_only(tmp_path, placements):
    """params on host: the forward and backward read the bf16 parameters (2 + 2 B), the gradient goes down (2 B);
    the master, m and v never cross, against at least 24 B with the update on the device. The wide form adds the
    device placement, whose state stays where it is updated."""
    only = [a for p in placements for a in ("--only", p)]
    out = run("--platform", "cpu", "--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16", "--grad-accum",
              "1", "--steps", "3", *only, "--update-on", "host", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout)["runs"]
    host = runs["host"]
    assert set(runs) == set(placements)
    if "device" in runs:
        assert runs["device"]["update_on"] == "device"  # the state on the device is updated there
    assert host["update_on"] == "host" and host["host_memory_kind"] == "pinned_host"
    assert 6 <= host["host_link_bytes_per_param"] < 7
