"""A layer larger than memory trains through the front door: ``zinfjax train`` in a memory cgroup, ``tiles=auto``.

Each run is ``zinfjax train`` in a fresh process inside a cgroup v1 memory group (page cache included,
`zinfjax.benchmarks.cgroup`), every tier on NVMe, ``memory_limit`` left to its default (the cgroup's
limit less a margin), batch 1 x 64:

- short form (``make test``): 2 layers of d_model 1024 and d_ff 32768, one block of 285 MB of fp32
  weights and 1.1 GB with Adam's moments, in a 1 GiB cgroup. Untiled it is refused in one line;
  ``tiles=auto`` picks tiles and trains;
- the full-size model (``wide``): examples/models/layer-larger-than-memory.yaml, one block of 2.4 GB of
  fp32 weights in a 2 GiB cgroup, fp32 and bf16, 3 steps.

Each trains with finite losses, no OOM kill, and a peak RSS below the cgroup's limit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from zinfjax.benchmarks.cgroup import MemoryCgroup, train_in_cgroup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LARGE = os.path.join(ROOT, "examples", "models", "layer-larger-than-memory.yaml")
MID = "arch: gpt2\nvocab_size: 256\nmax_seq_len: 64\nd_model: 1024\nn_layers: 2\nn_heads: 32\nd_ff: 32768\n"
NVME = ["params=nvme", "optimizer=nvme", "gradients=nvme", "activations=nvme", "batch_size=1", "seq_len=64"]


def _train(model: str, limit: int, tmp_path, steps: int, *extra: str) -> dict:
    assert MemoryCgroup.available(), "these tests run zinfjax train in a cgroup v1 memory group: run them as root"
    sets = [f"model={model}", f"nvme_path={tmp_path / 'nvme'}", f"steps={steps}", *NVME, *extra]
    result = train_in_cgroup(sets, limit, str(tmp_path / "run"))
    print(json.dumps(result))
    return result


def _assert_trained(result: dict, limit: int, steps: int) -> dict:
    assert "error" not in result, result
    assert result["oom_kills"] == 0 and result["steps_completed"] == steps
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["peak_rss_GB"] * 1e9 < limit
    with open(result["log"]) as f:
        log = json.load(f)
    assert log["tiles"] > 1 and log["streamed_tiles"] == log["tiles"]  # stream_tiles=auto: the layer does not fit
    return log


@pytest.mark.slow
def test_a_block_larger_than_its_cgroup_is_refused_untiled_and_trains_in_tiles(tmp_path):
    (tmp_path / "mid.yaml").write_text(MID)
    limit = 1 << 30
    untiled = _train(str(tmp_path / "mid.yaml"), limit, tmp_path / "untiled", 1, "tiles=1")
    assert "cannot train this model" in untiled["error"] and untiled["error"].startswith("zinfjax: error:")
    log = _assert_trained(_train(str(tmp_path / "mid.yaml"), limit, tmp_path / "auto", 2), limit, 2)
    assert log["largest_operation_bytes"] < 285e6  # less than the block's fp32 weights alone


@pytest.mark.wide
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_full_size_model_one_block_of_2_4_GB_trains_in_a_2_GiB_cgroup(tmp_path, precision):
    limit = 2 << 30
    log = _assert_trained(_train(LARGE, limit, tmp_path, 3, f"precision={precision}"), limit, 3)
    assert log["largest_operation_bytes"] < 2.4e9 / 8


def test_a_tile_count_that_does_not_divide_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", "train", "--quiet", "--set", "tiles=3",
                          "--set", "steps=1"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("zinfjax: error: tiles=3 does not divide d_ff=256, n_heads=8, n_kv_heads=8; tile "
                                  "counts that divide d_ff, n_heads, n_kv_heads: 1, 2, 4, 8")
