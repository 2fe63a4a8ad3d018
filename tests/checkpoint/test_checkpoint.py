"""Checkpoints: orbax layout, asynchronous and atomic saves, resharding restores, bad input.

A flipped byte in any chunk is caught by its crc32c, and a failed save keeps the previous one: invariant 4
(docs/design.md).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax.training import train_state

from tests.support.engine_helpers import _tx, batches, config, exact_run, initial_params, make_engine
from tests.support.mounts import tmpfs
from tests.support.tolerances import assert_loss_no_farther
from tests.support.xla_flags import child_env
from zinfjax import Config, models, wrap
from zinfjax._util.byte_sizes import format_bytes
from zinfjax.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointSource,
    CheckpointWriter,
    complete_steps,
    expected_leaves,
    inspect,
    read_meta,
)
from zinfjax.checkpoint.snapshot import leaf_name
from zinfjax.sharding import path_str

NVME = dict(params="nvme", optimizer="nvme", gradients="nvme", activations="nvme")


def restore(c, path):
    """An engine for ``c`` started from the checkpoint at ``path``, and its source."""
    made = []

    def source(program, plan):
        made.append(CheckpointSource(path, program, plan))
        return made[0]

    engine = make_engine(c, source=source)
    return engine, made[0]


def losses_after(engine, c, position, steps):
    data = batches(c)
    data.position = position
    return [engine.train_step(next(data))["loss"] for _ in range(steps)]


@pytest.mark.numeric
def test_stage3_nvme_on_8_devices_restores_at_stage1_in_memory_on_2(tmp_path):
    """Saved asynchronously mid-run at stage 3 / 8 devices / nvme; restored at stage 1 / 2 devices / device."""
    c = config(stage=3, mesh="data:8", nvme_path=str(tmp_path / "nvme"), **NVME)
    engine, data = make_engine(c), batches(c)
    manager = CheckpointManager(str(tmp_path / "ckpt"))
    losses = [engine.train_step(next(data))["loss"] for _ in range(2)]
    manager.save(engine)
    saved = jax.tree.map(np.asarray, engine.params())
    losses += [engine.train_step(next(data))["loss"] for _ in range(3)]  # while the save runs
    manager.close()
    engine.close()
    assert complete_steps(str(tmp_path / "ckpt")) == [2]

    # A plain orbax user restores the parameters, bitwise.
    plain = ocp.PyTreeCheckpointer().restore(str(tmp_path / "ckpt" / "2" / "params"))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, b)

    c2 = config(stage=1, mesh="data:2")
    restored, source = restore(c2, str(tmp_path / "ckpt"))
    assert source.step == restored.step_count == 2
    resumed = losses_after(restored, c2, source.data_position, 3)
    restored.close()
    # steps 3-5 sum over 2 devices, not 8: no farther from the reference loop in float64 (the same 5 steps) than the
    # uninterrupted run is (tests/support/tolerances.py); five steps leave the losses within a few units of fp32,
    # where the order of a loss's mean over its tokens decides
    assert_loss_no_farther(exact_run(config(), 5)[0][2:], losses[2:], resumed, terms=c.batch_size * c.seq_len)


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", *args], capture_output=True, text=True,
                         env=child_env())  # one device, the tests' compile flags
    assert out.returncode == 0, out.stderr
    return out


def log_steps(path) -> list[dict]:
    return json.loads(open(path).read())["steps"]


@pytest.mark.slow  # two training processes
def test_resume_in_a_new_process_is_bitwise(tmp_path):
    """Train 6 steps saving at 3; a new process resumes from 3 (other tiers) and steps 4-6 match bitwise.

    The run warms up for 2 steps and decays on a cosine: the schedule's count is in the optimizer
    state, so the resumed learning rates are the uninterrupted run's too.
    """
    common = ["--set", "model=gpt2-tiny", "--set", "batch_size=8", "--set", "seq_len=16", "--set", "mesh=data:1",
              "--set", "steps=6", "--set", f"save_dir={tmp_path / 'ckpt'}", "--quiet", "--set", "warmup_steps=2",
              "--set", "lr_decay=cosine", "--set", "final_lr=1e-5"]
    nvme = ["--set", "params=nvme", "--set", "optimizer=nvme", "--set", f"nvme_path={tmp_path / 'nvme'}"]
    run_cli(["train", *common, *nvme, "--set", "save_every=3", "--set", f"log={tmp_path / 'a.json'}"])
    assert complete_steps(str(tmp_path / "ckpt")) == [3, 6]
    shutil.rmtree(tmp_path / "ckpt" / "6")
    out = run_cli(["train", *common, "--set", "resume=true", "--set", "optimizer=host",
                   "--set", f"log={tmp_path / 'b.json'}"])
    assert "resuming from checkpoint" in out.stderr and "(step 3)" in out.stderr
    a, b = log_steps(tmp_path / "a.json"), log_steps(tmp_path / "b.json")
    assert [r["step"] for r in b] == [4, 5, 6]
    assert [r["loss"] for r in b] == [r["loss"] for r in a[3:]]
    assert [r["lr"] for r in b] == [r["lr"] for r in a[3:]]
    assert len({r["lr"] for r in a}) == 6  # warmup, then decay: no two steps alike


def test_corrupt_chunk_is_detected(tmp_path):
    c = config(mesh="data:2", params="host", optimizer="host")
    engine = make_engine(c)
    engine.train_step(next(batches(c)))
    with CheckpointManager(str(tmp_path / "ckpt")) as manager:
        manager.save(engine)
    engine.close()
    chunk = sorted(glob.glob(str(tmp_path / "ckpt" / "1" / "opt_state" / "*.blocks.*" / "c" / "2" / "*")))[0]
    with open(chunk, "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointCorruptError, match=r"corrupt at leaf opt_state/\d\.\w+\.blocks\..*, layer 2"):
        restore(c, str(tmp_path / "ckpt"))


def test_other_model_is_refused_with_the_leaves(tmp_path):
    c = config(mesh="data:1", params="host")
    engine = make_engine(c)
    with CheckpointManager(str(tmp_path / "ckpt")) as manager:
        manager.save(engine)
    engine.close()
    with pytest.raises(CheckpointMismatchError) as err:
        restore(config(mesh="data:1", model="llama-tiny"), str(tmp_path / "ckpt"))
    message = str(err.value)
    assert "\n" not in message
    assert re.search(r"params/blocks\.\w+\.kernel: missing from the checkpoint", message), message
    assert re.search(r"params/blocks\.\w+\.\w+: in the checkpoint but not in this run", message), message
    assert re.search(r"\(\d+ leaves differ: .*; and \d+ more\)", message), message


def test_full_disk_fails_the_save_and_keeps_the_previous(tmp_path):
    c = config(mesh="data:1", params="host", optimizer="host")
    engine, data = make_engine(c), batches(c)
    with tmpfs(tmp_path / "small", "6m") as small:  # one checkpoint (3.7 MB) fits, two do not
        manager = CheckpointManager(str(small / "ckpt"), keep=2)
        engine.train_step(next(data))
        manager.save(engine)
        manager.wait()
        engine.train_step(next(data))
        manager.save(engine)
        with pytest.raises(CheckpointSaveError, match=r"is full.*previous checkpoint \(step 1\) is intact"):
            manager.wait()
        assert complete_steps(str(small / "ckpt")) == [1]
        assert not [n for n in os.listdir(small / "ckpt") if n.startswith(".tmp")]
        assert np.isfinite(engine.train_step(next(data))["loss"])  # training goes on
        restored, source = restore(c, str(small / "ckpt"))
        assert source.step == 1
        restored.close()
        manager.close()
    engine.close()


def test_unwritable_save_dir_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointSaveError, match="choose a writable save_dir"):
        CheckpointManager(str(tmp_path / "file" / "ckpt"))


def test_info_and_bf16_export(tmp_path):
    c = config(mesh="data:2", params="nvme", optimizer="host", nvme_path=str(tmp_path / "nvme"))
    engine = make_engine(c)
    engine.train_step(next(batches(c)))
    with CheckpointManager(str(tmp_path / "ckpt"), config=c) as manager:
        manager.save(engine)
    params = jax.tree.map(np.asarray, engine.params())
    engine.close()
    text = inspect.info_text(str(tmp_path / "ckpt"))
    assert "steps: 1" in text and "blocks.fc.kernel" in text and "(4, 64, 256)" in text
    total = format_bytes(sum(x.nbytes for x in jax.tree.leaves(params)))
    assert f"nvme {total} (params/s:embed.wte.embedding, params/w:embed.wpe.embedding, params/s:blocks, " \
           "params/w:head.ln_f" in text and "stage=0" in text
    out = inspect.export_params(str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "bf16")
    assert out["dtype"] == "bfloat16" and out["bytes"] == sum(x.size * 2 for x in jax.tree.leaves(params))
    exported = ocp.PyTreeCheckpointer().restore(str(tmp_path / "bf16"))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(exported), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a.astype(jnp.bfloat16), b)


def as_saved(c: Config) -> dict:
    """``c`` as a checkpoint's zinfjax.json holds it."""
    return json.loads(json.dumps(c.to_dict()))


def test_a_wrapped_states_checkpoint_records_its_config_as_given(tmp_path):
    """The engine's budget settles its read-ahead and buffers, and ``update_on=auto`` its place, for the engine alone:
    a manager given no config records the wrapped state's, as the user gave it."""
    c = config(mesh="data:1", params="nvme", optimizer="host", nvme_path=str(tmp_path / "nvme"))
    model = models.build(c.model)
    state = train_state.TrainState.create(apply_fn=model.apply, params=initial_params(c), tx=optax.adamw(c.lr))
    with wrap(state, c) as wrapped:
        wrapped.train_step(next(batches(c)))
        with CheckpointManager(str(tmp_path / "ckpt")) as manager:
            manager.save(wrapped)
        engine = wrapped.engine
        assert (engine.budget.prefetch_depth > 0, engine.budget.host_buffer_bytes > 0, engine.update_on) == \
               (True, True, "device")
    saved = read_meta(str(tmp_path / "ckpt" / "1"))["config"]
    assert saved == as_saved(c) and wrapped.config == c
    assert (saved["prefetch_depth"], saved["host_buffer_bytes"], saved["update_on"]) == (None, None, "auto")


def test_a_runs_checkpoints_record_the_config_it_was_given(tmp_path, monkeypatch):
    """``zinfjax train`` with ``tiers=auto`` runs the placement its plan chose (its log records it), and resumed with
    ``resume=true`` runs from step 1; its checkpoints record the config as given: tiers=auto, resume=true."""
    from zinfjax.training.loop import run

    monkeypatch.setenv("ZINFJAX_PLAN_PROBE", "0")
    first = Config(batch_size=2, seq_len=16, mesh="data:1", steps=1, tiers="auto", save_dir=str(tmp_path / "ckpt"))
    log = run(first, progress=False)
    assert log["config"]["tiers"] == "manual"  # the run's own: the plan's placement
    assert read_meta(str(tmp_path / "ckpt" / "1"))["config"] == as_saved(first)
    resumed = first.replace(steps=2, resume=True)
    log = run(resumed, progress=False)
    assert log["config"]["resume"] == 1 and log["resumed_from"]["step"] == 1
    assert read_meta(str(tmp_path / "ckpt" / "2"))["config"] == as_saved(resumed)


def test_writer_builds_a_checkpoint_leaf_by_leaf(tmp_path):
    """A converter's path: every leaf written layer by layer; the run from it equals the run from the params."""
    c = config(mesh="data:1")
    params = jax.tree.map(np.asarray, initial_params(c))
    tx = _tx(c)
    leaves = expected_leaves(params, tx)
    with pytest.raises(CheckpointError, match="3 chunks were never written|chunks were never written"):
        with CheckpointWriter(str(tmp_path / "ckpt"), 0, leaves, config=c) as writer:
            writer.write("params", "blocks.fc.kernel", 0, params["blocks"]["fc"]["kernel"][0])
            writer.commit()
    assert complete_steps(str(tmp_path / "ckpt")) == []
    trees = {"params": params, "opt_state": tx.init(params)}
    with CheckpointWriter(str(tmp_path / "ckpt"), 0, leaves, config=c) as writer:
        for item, tree in trees.items():
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
                leaf = leaves[item][leaf_name(path_str(path))]
                for i in range(x.shape[0]) if leaf.stacked else [None]:
                    writer.write(item, leaf.name, i, np.asarray(x[i] if i is not None else x))
    engine, source = restore(c, str(tmp_path / "ckpt"))
    assert source.step == 0
    fresh = make_engine(c)
    assert losses_after(engine, c, 0, 2) == losses_after(fresh, c, 0, 2)
    engine.close()
    fresh.close()


    # Whole-layer chunks are read directly; every layer equals tensorstore's reading of the zarr array.
    from zinfjax.checkpoint import read_meta
    from zinfjax.checkpoint.reader import LeafReader, _one_chunk

    path = str(tmp_path / "ckpt" / "0")
    items = read_meta(path)["items"]
    reader, direct = LeafReader(path, items), 0
    for item, metas in items.items():
        for name, meta in metas.items():
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, item, name)}}
            whole = ts.open(spec, open=True, read=True).result().read().result()
            stacked = leaves[item][name].stacked
            for i in range(meta["shape"][0]) if stacked else [None]:
                got = reader.read(item, name, i)
                assert got.dtype == whole.dtype
                np.testing.assert_array_equal(got, whole[i] if i is not None else whole)
                direct += _one_chunk(meta, i)
    assert direct > 20
    os.remove(os.path.join(path, "params", "blocks.fc.kernel", "c", "1", "0", "0"))
    with pytest.raises(CheckpointCorruptError, match=r"corrupt at leaf params/blocks.fc.kernel, layer 1: chunk file "
                       r".*/c/1/0/0 is missing"):
        reader.read("params", "blocks.fc.kernel", 1)
