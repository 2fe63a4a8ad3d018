"""A part of the state split across tiers by layer (``host:1,nvme``): bitwise the run with every part on one tier
(invariant 3), its bytes counted on the tier each layer is on, and checkpoints that do not depend on the split."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.support.engine_helpers import assert_bitwise, config, engine_run, make_engine
from zinfjax.errors import ConfigError
from zinfjax.store import open_store
from zinfjax.store.errors import StoreUsageError

SPLITS = [  # (params, optimizer, gradients, activations, numerics)
    ("host:1,nvme", "nvme:1,host", "host:1,nvme", "host:1,nvme", {"grad_clip": 0.05}),
    ("nvme", "host:1,nvme", "device", "nvme:1,host", {"grad_accum": 2}),
]


@pytest.mark.parametrize("params,optimizer,gradients,activations,numerics", SPLITS)
def test_a_split_is_bitwise_the_run_on_one_tier(tmp_path, params, optimizer, gradients, activations, numerics):
    """gpt2-tiny has four layers: each split puts one on the first tier and three on the other; the run equals the
    device run bit for bit."""
    device_losses, device_params, _ = engine_run(config(**numerics), 3)
    c = config(**numerics, params=params, optimizer=optimizer, gradients=gradients, activations=activations,
               nvme_path=str(tmp_path))
    losses, final, metrics = engine_run(c, 3)
    assert losses == device_losses
    assert_bitwise(device_params, final)
    last = metrics[-1]
    assert last["read_bytes_host"] > 0 and last["read_bytes_nvme"] > 0
    assert last["write_bytes_host"] > 0 and last["write_bytes_nvme"] > 0


def test_each_layer_is_on_its_own_tier(tmp_path):
    """Layer 0 in host memory, layers 1-2 in the nvme store, which holds those two alone."""
    import jax
    import jax.numpy as jnp

    like = {"w": jax.ShapeDtypeStruct((3, 4, 8), jnp.float32)}
    with open_store("host:1,nvme", like, path=str(tmp_path), name="w") as store:
        for i in range(3):
            store.write(i, {"w": np.full((4, 8), i, np.float32)}).result()
        assert [store.tier_at(i) for i in range(3)] == ["host", "nvme", "nvme"]
        assert [float(store.read(i).result()["w"][0, 0]) for i in range(3)] == [0.0, 1.0, 2.0]
        manifest = json.load(open(tmp_path / "w" / "manifest.json"))
        assert manifest["num_layers"] == 2
        assert store.stats.bytes_written == 3 * 4 * 8 * 4
    with pytest.raises(StoreUsageError, match="unknown tier"):
        open_store("fast:1,nvme", like, path=str(tmp_path))


def test_a_split_naming_more_layers_than_the_model_has_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"optimizer=host:5,nvme names 5 layers, but the model's optimizer stores "
                                          r"have at most 4; name 4 or fewer"):
        make_engine(config(optimizer="host:5,nvme", nvme_path=str(tmp_path)))
    assert not os.listdir(tmp_path)  # refused before anything is written


@pytest.mark.parametrize("value,says", [
    ("host:4,fast", "the last term of 'host:4,fast' must be host or nvme alone"),
    ("device:4,nvme", "'device:4' in 'device:4,nvme' is not TIER:COUNT"),
    ("host:4,host", "names a tier twice"),
    ("host:0,nvme", "a count of 1 or more"),
    ("ram", "'ram' is not a tier or a split"),
])
def test_a_bad_split_is_one_line(value, says):
    with pytest.raises(ConfigError, match="optimizer: ") as e:
        config(optimizer=value, nvme_path="/tmp")
    assert says in str(e.value) and "\n" not in str(e.value)


def _cli(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", "train", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _chunks(step_dir) -> dict[str, str]:
    """sha256 of every chunk file of a checkpoint's parameters and optimizer state."""
    out = {}
    for item in ("params", "opt_state"):
        for root, _, files in os.walk(os.path.join(step_dir, item)):
            for name in files:
                path = os.path.join(root, name)
                out[os.path.relpath(path, step_dir)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.mark.slow  # three training processes
@pytest.mark.wide
def test_a_checkpoint_resumes_bitwise_with_another_split(tmp_path):
    """Saved at step 3 with one split, resumed with another and with every part on NVMe: the step-6 checkpoints
    are the uninterrupted run's, file for file, and so are the losses."""
    common = ["--set", "model=gpt2-tiny", "--set", "batch_size=8", "--set", "seq_len=16", "--set", "mesh=data:1",
              "--set", "steps=6", "--set", "save_every=3", "--quiet", "--set", "precision=bf16"]

    def run(name: str, *tiers: str, resume_from=None) -> list[float]:
        save = tmp_path / (resume_from or name)
        args = [*common, "--set", f"save_dir={save}", "--set", f"nvme_path={tmp_path / 'nvme'}",
                "--set", f"log={tmp_path / name}.json", *[a for t in tiers for a in ("--set", t)]]
        if resume_from:
            args += ["--set", "resume=true"]
        _cli(*args)
        return [r["loss"] for r in json.load(open(tmp_path / f"{name}.json"))["steps"]]

    first = run("a", "params=host:1,nvme", "optimizer=nvme:1,host", "activations=host:1,nvme")
    whole = _chunks(tmp_path / "a" / "6")
    assert any(p.startswith("opt_state") for p in whole) and any(p.startswith("params") for p in whole)
    for name, tiers in (("b", ("params=nvme", "optimizer=nvme", "activations=nvme")),
                        ("c", ("params=nvme:1,host", "optimizer=host:1,nvme"))):
        shutil.copytree(tmp_path / "a", tmp_path / name, ignore=lambda d, names: ["6"] if d == str(tmp_path / "a")
                        else [])
        resumed = run(name, *tiers, resume_from=name)
        assert resumed == first[3:]
        assert _chunks(tmp_path / name / "6") == whole


def test_a_split_that_does_not_fit_the_budget_says_how_many_layers_to_move(tmp_path):
    """gpt2-small's optimizer state, 12 layers of it in host memory, against a budget 1 GiB above this process: refused
    before any store opens, naming the split that fits; that split then builds."""
    import re

    from zinfjax.engine.budget import MemoryBudgetError
    from zinfjax.runtime import rss
    from zinfjax.trainers.build import build_trainer

    c = config(model="gpt2-small", batch_size=1, seq_len=64, mesh="data:1", tiles="1", params="nvme",
               activations="nvme", optimizer="host:12,nvme", nvme_path=str(tmp_path / "nvme"),
               memory_limit=rss.current_bytes() + (1 << 30))
    with pytest.raises(MemoryBudgetError) as e:
        build_trainer(c)
    message = str(e.value)
    assert "\n" not in message and "optimizer=host:12,nvme holds 770.8 MiB in host memory" in message
    fewer, kept = re.search(r"optimizer=host:(\d+),nvme \((\d+) fewer layers of 64.2 MiB\) fits", message).group(2, 1)
    assert int(fewer) + int(kept) == 12 and 0 < int(kept) < 12
    assert not (tmp_path / "nvme").exists()  # nothing written
    _, trainer = build_trainer(c.replace(optimizer=f"host:{kept},nvme"))
    try:
        assert trainer.engine.stores.opt["s:blocks"].tier == f"host:{kept},nvme"
    finally:
        trainer.close()
