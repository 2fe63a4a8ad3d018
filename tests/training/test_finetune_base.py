"""LoRA on a base checkpoint (``model=<checkpoint>``): the base is read, never written; checkpoints hold the adapters.

A real base: llama-tiny trained a few steps by ``zinfjax train`` into a checkpoint. Fine-tunes of it, through the
trainer ``zinfjax train`` builds (`build_trainer`), are compared with the in-memory optax loop starting from the
same checkpoint with the same frozen mask: no farther from that loop run in float64 than the fp32 loop is (losses
within ``LOSS_SLACK``, adapters within ``SLACK`` in whole-tree relative L2; tests/support/tolerances.py), and the
base bitwise as saved, its files unchanged on disk (a hash of every file before and after).
"""

import functools
import hashlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.engine_helpers import batches, relative_error
from tests.support.tolerances import assert_no_farther, in_float64, loss_distance
from tests.test_any_model import float32_dropout_masks
from zinfjax import Config, models
from zinfjax.checkpoint import read_meta
from zinfjax.checkpoint.base import BaseChangedError, base_ref
from zinfjax.checkpoint.reader import LeafReader
from zinfjax.cli import main
from zinfjax.inference.evaluate import evaluate
from zinfjax.models.lora import is_adapter
from zinfjax.sharding import make_mesh, replicated
from zinfjax.trainers.build import build_trainer, run_model
from zinfjax.trainers.reference import ReferenceTrainer
from zinfjax.training.loop import run

NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")
# lr 1e-3, as the other exactness tests: Adam carries a gradient's rounding noise as far as the learning rate.
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets="q,v", batch_size=8, seq_len=16, lr=1e-3)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A llama-tiny checkpoint trained 2 steps by zinfjax train (fp32, one layer a chunk)."""
    root = tmp_path_factory.mktemp("base")
    run(Config(model="llama-tiny", steps=2, batch_size=8, seq_len=16, save_dir=str(root / "ckpt"),
               log=str(root / "log.json")), progress=False)
    return str(root / "ckpt")


def files_digest(directory: str) -> str:
    """A hash of every file under ``directory``: its relative path and its bytes."""
    h = hashlib.sha256()
    for here, dirs, files in os.walk(directory):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(here, f)
            h.update(os.path.relpath(path, directory).encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def flat(params) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def trained(c: Config, steps: int):
    """Losses and final params of the trainer ``zinfjax train`` builds for ``c``."""
    _, trainer = build_trainer(c)
    try:
        data = batches(c)
        losses = [trainer.step(trainer.next_batch(data))["loss"] for _ in range(steps)]
        params = trainer.engine.params() if trainer.engine is not None else trainer.params
        facts = (trainer.engine.in_place, trainer.engine.base) if trainer.engine is not None else None
        return [float(x) for x in losses], flat(params), facts
    finally:
        trainer.close()


@functools.cache
def exact_trained(c: Config, steps: int):
    """Losses and final params of the in-memory reference trainer for ``c`` in float64 (``jax.enable_x64``), from
    the fp32 run's initial params, dropout drawing the fp32 run's masks: the run fp32 runs are judged against
    (tests/support/tolerances.py)."""
    _, fresh = build_trainer(c)
    assert fresh.engine is None  # the reference trainer: its params are the fp32 run's initial ones
    start = jax.tree.map(np.asarray, fresh.params)
    fresh.close()
    c, model_config = run_model(c)
    with jax.enable_x64(True), float32_dropout_masks():
        mesh = make_mesh(c.mesh_axes())
        trainer = ReferenceTrainer(c, models.build(model_config, jnp.float64), mesh)
        trainer.params = jax.device_put(in_float64(start), replicated(mesh))
        trainer.opt_state = jax.jit(trainer.tx.init, out_shardings=replicated(mesh))(trainer.params)
        data = batches(c)
        losses = [trainer.step(trainer.next_batch(data))["loss"] for _ in range(steps)]
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(trainer.params))  # no silent fp32
        return losses, flat(trainer.params)


def saved_base(base: str) -> dict:
    """The base checkpoint's params, by the key strings `flat` gives."""
    directory = os.path.join(base, str(max(int(n) for n in os.listdir(base) if n.isdigit())))
    items = read_meta(directory)["items"]
    reader = LeafReader(directory, items)
    try:
        return {"".join(f"['{k}']" for k in name.split(".")): reader.read("params", name, None)
                for name in items["params"]}
    finally:
        reader.close()


def check_exact(base, steps, **extra):
    before = files_digest(base)
    ref_losses, ref, _ = trained(Config(model=base, **LORA), steps)
    losses, ours, (in_place, ref_base) = trained(Config(model=base, **LORA, **extra), steps)
    exact_losses, exact = exact_trained(Config(model=base, **LORA), steps)
    adapters = {k for k in ours if "_lora" in k}
    assert len(adapters) == 4
    assert_no_farther(*({k: run[k] for k in adapters} for run in (exact, ref, ours)), relative_error)
    assert_no_farther(exact_losses, ref_losses, losses, loss_distance)
    start = saved_base(base)
    assert set(start) == set(ours) - adapters
    for k, x in start.items():  # the base as it was saved, in both loops
        np.testing.assert_array_equal(ours[k], x, err_msg=k)
        np.testing.assert_array_equal(ref[k], x, err_msg=k)
    assert files_digest(base) == before  # not a byte of the base changed on disk
    assert ref_base["digest"] == base_ref(base)["digest"]
    return in_place


@pytest.mark.numeric
def test_lora_on_a_base_checkpoint_is_exact_and_reads_the_base_in_place(base, tmp_path):
    in_place = check_exact(base, 6, nvme_path=str(tmp_path / "nv"), **NVME)
    assert {p for paths in in_place.values() for p in paths} >= {"blocks/q/kernel", "blocks/down/kernel"}
    held = os.listdir(tmp_path / "nv" / "params_blocks")
    assert not [n for n in held if n.endswith("kernel")]  # no base matrix copied into nvme_path


@pytest.mark.wide
@pytest.mark.numeric
def test_lora_on_a_base_checkpoint_is_exact_at_stage_3_on_4_devices(base, tmp_path):
    in_place = check_exact(base, 20, nvme_path=str(tmp_path / "nv"), stage=3, mesh="data:4", **NVME)
    placed = {p for paths in in_place.values() for p in paths}
    assert not [p for p in placed if p.endswith("kernel")]  # stage 3 shards the matrices: copied, cut by device
    assert placed <= {"blocks/attn_norm/scale", "blocks/mlp_norm/scale"}  # small ones stay whole: in place


def log_of(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.numeric  # the resumed run's losses equal the whole run's, bit for bit
def test_checkpoints_hold_the_adapters_name_the_base_and_resume_exactly(base, tmp_path):
    c = Config(model=base, **LORA, **NVME, nvme_path=str(tmp_path / "nv"), save_dir=str(tmp_path / "run"),
               save_every=2)
    run(c.replace(steps=4, log=str(tmp_path / "a.json")), progress=False)
    meta = read_meta(str(tmp_path / "run" / "4"))
    assert sorted(meta["items"]["params"]) == ["blocks.q_lora.a", "blocks.q_lora.b", "blocks.v_lora.a",
                                               "blocks.v_lora.b"]
    assert all("_lora" in n for n in meta["items"]["opt_state"] if "count" not in n)
    assert meta["base"] == base_ref(base)
    facts = log_of(str(tmp_path / "a.json"))["frozen"]
    assert facts["base"]["in_place_bytes"] > 0 and facts["trainable_leaves"] == 4
    run(c.replace(steps=6, resume=True, log=str(tmp_path / "b.json")), progress=False)
    whole = tmp_path / "whole"
    run(c.replace(steps=6, save_dir=str(whole), nvme_path=str(tmp_path / "nv2"), log=str(tmp_path / "w.json")),
        progress=False)
    resumed = [s["loss"] for s in log_of(str(tmp_path / "a.json"))["steps"] + log_of(str(tmp_path / "b.json"))["steps"]]
    assert resumed == [s["loss"] for s in log_of(str(tmp_path / "w.json"))["steps"]]


def test_evaluate_and_generate_take_the_base_plus_the_adapters(base, tmp_path):
    c = Config(model=base, **LORA, save_dir=str(tmp_path / "run"), steps=3)
    run(c.replace(log=str(tmp_path / "log.json")), progress=False)
    adapters = evaluate(str(tmp_path / "run"), "demo", Config(batch_size=8, seq_len=16), batches=2)
    plain = evaluate(base, "demo", Config(batch_size=8, seq_len=16), batches=2)
    assert np.isfinite(adapters["loss"]) and adapters["loss"] != plain["loss"]  # the adapters are applied
    assert main(["generate", str(tmp_path / "run"), "--prompt-ids", "1,2,3", "--max-new-tokens", "3"]) == 0


def test_a_base_that_changed_is_refused_naming_both_digests(base, tmp_path, capsys):
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    c = Config(model=str(copy), **LORA, save_dir=str(tmp_path / "run"), steps=2)
    run(c.replace(log=str(tmp_path / "a.json")), progress=False)
    was = base_ref(str(copy))["digest"]
    run(Config(model="llama-tiny", steps=1, batch_size=8, seq_len=16, seed=7, save_dir=str(copy), overwrite=True,
               log=str(tmp_path / "other.json")), progress=False)  # another base under the same path
    step = max(int(n) for n in os.listdir(copy) if n.isdigit())
    os.rename(copy / str(step), copy / "2")  # where the adapter's checkpoint looks for it
    now = base_ref(str(copy))["digest"]
    capsys.readouterr()
    assert main(["train", "--quiet", "--set", f"model={copy}", "--set", "lora_rank=4", "--set", "lora_alpha=8",
                 "--set", f"save_dir={tmp_path / 'run'}", "--set", "resume=true", "--set", "steps=4",
                 "--set", "batch_size=8", "--set", "seq_len=16", "--set", "lr=0.001"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and was in err[0] and now in err[0] and "changed" in err[0], err
    with pytest.raises(BaseChangedError):
        evaluate(str(tmp_path / "run"), "demo", Config(batch_size=8, seq_len=16), batches=1)


@pytest.mark.numeric
@pytest.mark.wide
def test_lora_dropout_is_exact_and_changes_the_run(tmp_path):
    c = Config(model="llama-tiny", **{**LORA, "batch_size": 16, "lr": 1e-2}, grad_accum=2, lora_dropout=0.3)
    ref, _, _ = trained(c, 4)
    ours, _, _ = trained(c.replace(nvme_path=str(tmp_path), **NVME), 4)
    assert_no_farther(exact_trained(c, 4)[0], ref, ours, loss_distance)
    without, _, _ = trained(c.replace(lora_dropout=0.0), 4)
    assert abs(without[-1] - ref[-1]) > 1e-4  # dropout acts


def test_a_bf16_lora_run_keeps_no_fp32_copy_of_the_base(tmp_path):
    c = Config(model="llama-tiny", **LORA, precision="bf16", nvme_path=str(tmp_path), **NVME)
    _, trainer = build_trainer(c)
    try:
        master = trainer.engine.stores.master
        held = {p for store in master.values() for p in store.like}
        assert held and all(is_adapter(p.split("/")) for p in held)
        assert float(trainer.step(trainer.next_batch(batches(c)))["loss"]) > 0
    finally:
        trainer.close()
    assert sorted(os.listdir(tmp_path / "master_blocks")) == ["blocks_q_lora_a", "blocks_q_lora_b", "blocks_v_lora_a",
                                                             "blocks_v_lora_b", "manifest.json"]
