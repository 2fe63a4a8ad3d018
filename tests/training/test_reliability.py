"""Each probe of a careless or unlucky user, numbered by kind (the test names' prefixes), and what it does now.

Each bad input must give one line, ``zinfjax: error: ...``, exit status 2 and lose nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.support.mounts import tmpfs
from zinfjax.checkpoint import CheckpointManager, complete_steps, inspect, read_meta
from zinfjax.checkpoint.verify import verify_save_dir
from zinfjax.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model=gpt2-tiny", "batch_size=2", "seq_len=16", "mesh=data:1"]


def cli(capsys, *argv) -> tuple[int, str, str]:
    """``zinfjax *argv`` in this process: (exit status, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def train(capsys, *settings, config: str | None = None) -> tuple[int, str, str]:
    """``zinfjax train --quiet`` of the tiny model with ``--set`` for each of ``settings``."""
    sets = [arg for s in [*TINY, *settings] for arg in ("--set", str(s))]
    return cli(capsys, "train", *([config] if config else []), "--quiet", *sets)


def one_error(code: int, err: str) -> str:
    """The one error line of a refused command: exit status 2, no traceback, any other line a note or warning."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("zinfjax: error: ")]
    assert code == 2 and len(errors) == 1 and all(line.startswith("zinfjax: ") for line in lines), err
    return errors[0].removeprefix("zinfjax: error: ")


def snapshot(directory) -> dict[str, bytes]:
    """Every file under ``directory`` with its bytes: what "loses nothing" compares."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """A finished run: 4 steps, saved at 2 and 4."""
    save_dir = tmp_path_factory.mktemp("run_a") / "ckpt"
    assert main(["train", "--quiet", *[a for s in [*TINY, "steps=4", "save_every=2", f"save_dir={save_dir}"]
                                       for a in ("--set", s)]]) == 0
    return save_dir


@pytest.fixture
def save_dir(run_a, tmp_path):
    """A copy of run A's save_dir, for a test to change."""
    shutil.copytree(run_a, tmp_path / "ckpt")
    return tmp_path / "ckpt"


# ---- 1. a save_dir belongs to one run -------------------------------------------------------------


def test_1_a_fresh_run_into_another_runs_save_dir_is_refused_and_loses_nothing(capsys, save_dir):
    before = snapshot(save_dir)
    run_id = read_meta(str(save_dir / "4"))["run_id"]
    message = one_error(*train(capsys, "steps=3", "save_every=1", "seed=1", f"save_dir={save_dir}")[::2])
    assert message == (f"save_dir {save_dir} holds the checkpoints of another run (steps 2, 4; run {run_id}; model "
                       "gpt2-tiny; seed 0); continue that run with resume=true, choose another save_dir, or set "
                       "overwrite=true to move them aside")
    assert snapshot(save_dir) == before


def test_1_a_resume_that_changes_the_seed_is_refused_unless_allowed(capsys, save_dir):
    before = snapshot(save_dir)
    message = one_error(*train(capsys, "steps=5", "seed=1", f"save_dir={save_dir}", "resume=true")[::2])
    assert message == (f"the checkpoint {save_dir}/4 was trained with seed 0 (this run: 1); resume with the "
                       f"checkpoint's settings (zinfjax ckpt info {save_dir} shows them), or set "
                       "allow_config_change=true to resume with this run's")
    assert snapshot(save_dir) == before
    code, _, err = train(capsys, "steps=5", "seed=1", f"save_dir={save_dir}", "resume=true", "allow_config_change=true")
    assert code == 0 and "allow_config_change=true: resuming with settings that differ from the checkpoint's: " \
                          "seed 0 (this run: 1)" in err
    assert complete_steps(str(save_dir)) == [2, 4, 5]
    assert read_meta(str(save_dir / "5"))["run_id"] == read_meta(str(save_dir / "4"))["run_id"]  # the same run


def test_1_other_model_and_optimizer_are_refused_on_resume(capsys, save_dir):
    message = one_error(*train(capsys, "steps=5", f"save_dir={save_dir}", "resume=true", "optimizer_name=sgd",
                               "lr=0.1")[::2])
    assert "was trained with optimizer_name 'adamw' (this run: 'sgd'), lr 0.0003 (this run: 0.1)" in message
    (save_dir.parent / "model.json").write_text(json.dumps(
        {**read_meta(str(save_dir / "4"))["model"], "norm_eps": 1e-6}))
    message = one_error(*train(capsys, "steps=5", f"save_dir={save_dir}", "resume=true",
                               f"model={save_dir.parent / 'model.json'}")[::2])
    assert "model.norm_eps 1e-05 (this run: 1e-06)" in message


def test_1_overwrite_moves_the_old_run_aside_whole(capsys, save_dir):
    before = snapshot(save_dir)
    code, _, err = train(capsys, "steps=3", "save_every=1", "seed=1", f"save_dir={save_dir}", "overwrite=true")
    assert code == 0
    aside = [n for n in os.listdir(save_dir) if n.startswith(".replaced-")]
    assert len(aside) == 1 and f"moved the checkpoints of the previous run (steps 2, 4) aside to {save_dir}" in err
    assert snapshot(save_dir / aside[0]) == before  # bit for bit
    assert complete_steps(str(save_dir)) == [1, 2, 3]
    assert read_meta(str(save_dir / "3"))["run_id"] != json.loads(before["4/zinfjax.json"])["run_id"]
    assert f"set aside (not resumed from; delete when no longer needed): {aside[0]}" in inspect.info_text(
        str(save_dir))


def test_1_resume_from_an_earlier_step_sets_the_later_ones_aside(capsys, save_dir):
    four = snapshot(save_dir / "4")
    code, _, err = train(capsys, "steps=4", "save_every=1", f"save_dir={save_dir}", "resume=2",
                         "keep_checkpoints=1")
    assert code == 0 and "resuming from checkpoint" in err and "(step 2)" in err
    aside = [n for n in os.listdir(save_dir) if n.startswith(".superseded-")]
    assert len(aside) == 1 and "moved step 4 (newer than step 2) aside" in err
    assert snapshot(save_dir / aside[0] / "4") == four
    assert complete_steps(str(save_dir)) == [4]  # pruned to keep_checkpoints=1: this run's own step 4
    # Resumed from step 2 with the same config, its step 4 is the first run's, bit for bit.
    assert {k: v for k, v in snapshot(save_dir / "4").items() if k != "zinfjax.json"} == \
           {k: v for k, v in four.items() if k != "zinfjax.json"}


def test_1_resume_to_a_missing_step_is_refused(capsys, save_dir):
    message = one_error(*train(capsys, "steps=5", f"save_dir={save_dir}", "resume=3")[::2])
    assert message == f"resume=3: {save_dir} has no checkpoint of step 3; its steps are 2, 4"


# ---- 2 and 3 of "what to build": exit codes that tell the truth ---------------------------------------


def test_2_a_failed_final_checkpoint_fails_the_run_with_the_newest_that_exists(capsys, tmp_path):
    log = tmp_path / "log.json"
    with tmpfs(tmp_path / "small", "1m") as small:
        code, _, err = train(capsys, "steps=4", "save_every=2", f"save_dir={small / 'ckpt'}", f"log={log}")
        message = one_error(code, err)
        assert "zinfjax: warning: checkpoint of step 2 failed: the disk holding" in err
        assert message.startswith(f"the final checkpoint (step 4) was not saved: the disk holding {small / 'ckpt'} "
                                  "is full (")
        assert message.endswith("free some space or point save_dir at a larger disk; no checkpoint exists")
    with tmpfs(tmp_path / "six", "6m") as six:  # one checkpoint (3.7 MB) fits, two do not
        code, _, err = train(capsys, "steps=4", "save_every=2", f"save_dir={six / 'ckpt'}", "keep_checkpoints=2")
        message = one_error(code, err)
        assert message.startswith("the final checkpoint (step 4) was not saved: the disk holding ")
        assert message.endswith("; the newest checkpoint is step 2 (resume=true continues from it)")
        assert complete_steps(str(six / "ckpt")) == [2]
    assert json.loads(log.read_text())["error"].startswith("the final checkpoint (step 4) was not saved")


def test_2_a_nan_loss_stops_the_run_and_keeps_the_newest_good_checkpoint(capsys, tmp_path):
    save_dir, log = tmp_path / "ckpt", tmp_path / "log.json"
    assert train(capsys, "steps=2", "save_every=1", f"save_dir={save_dir}")[0] == 0
    good = snapshot(save_dir / "2")
    # lr=1e9 from step 3: its loss is still finite (the parameters of step 2), step 4's is not.
    code, _, err = train(capsys, "steps=10", "save_every=1", "keep_checkpoints=1", "lr=1e9", f"save_dir={save_dir}",
                         "resume=true", "allow_config_change=true", f"log={log}")
    message = one_error(code, err)
    assert message == ("the loss was nan at steps 4-6, so training stopped at step 6 (max_nonfinite_steps=3); lower "
                       "lr (now 1e+09) or set grad_clip; the newest checkpoint with finite parameters is step 2: "
                       "continue from it with resume=2 allow_config_change=true and a lower lr; step 3 came after "
                       "the last finite loss and may hold non-finite parameters")
    assert complete_steps(str(save_dir)) == [2, 3]  # step 2 kept beyond keep_checkpoints=1; no NaN step saved
    assert snapshot(save_dir / "2") == good
    steps = json.loads(log.read_text())["steps"]
    assert [s["step"] for s in steps] == [3, 4, 5, 6] and np.isfinite(steps[0]["loss"])


def test_2_max_nonfinite_steps_is_the_number_of_steps_tolerated(capsys):
    message = one_error(*train(capsys, "steps=10", "lr=1e9", "max_nonfinite_steps=1")[::2])
    assert message.startswith("the loss was nan at step 2, so training stopped at step 2 (max_nonfinite_steps=1)")


def test_2_fp16_overflow_steps_are_skipped_not_counted(capsys, tmp_path):
    log = tmp_path / "log.json"
    code, _, err = train(capsys, "steps=6", "precision=fp16", "params=host", "max_nonfinite_steps=1", f"log={log}")
    assert code == 0, err
    steps = json.loads(log.read_text())["steps"]
    assert any(s["skipped"] for s in steps) and all(np.isfinite(s["loss"]) for s in steps)


# ---- 3. silent wrong output --------------------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [True, False])
def test_3_prompt_ids_outside_the_vocabulary_are_refused(capsys, run_a, as_json):
    code, out, err = cli(capsys, "generate", run_a, "--prompt-ids", "1,2,999", *(["--json"] if as_json else []))
    assert one_error(code, err) == "prompt token id 999 is outside the model's vocabulary of 256 (ids 0 to 255)"
    assert out == ""


# ---- 4. a damaged zinfjax.json ----------------------------------------------------------------------------


@pytest.mark.parametrize("damage,problem", [
    ("{not json", "it is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ("drop:items", "at the top level: 'items' is a required property"),
    ("drop:created", "at the top level: 'created' is a required property"),
    ("set:step=-4", "at step: -4 is less than the minimum of 0"),
])
def test_4_a_damaged_zinfjax_json_is_one_line_and_resume_falls_back(capsys, save_dir, damage, problem):
    meta_path = save_dir / "4" / "zinfjax.json"
    if damage.startswith("drop:"):
        meta = json.loads(meta_path.read_text())
        del meta[damage.removeprefix("drop:")]
        meta_path.write_text(json.dumps(meta))
    elif damage.startswith("set:"):
        meta = json.loads(meta_path.read_text())
        key, value = damage.removeprefix("set:").split("=")
        meta[key] = int(value)
        meta_path.write_text(json.dumps(meta))
    else:
        meta_path.write_text(damage)
    message = one_error(*cli(capsys, "ckpt", "info", save_dir)[::2])
    assert message.startswith(f"{meta_path} is damaged: {problem}; `zinfjax ckpt info <save_dir> --verify` lists")
    code, out, _ = cli(capsys, "ckpt", "info", save_dir, "--verify")
    assert code == 1 and out.splitlines()[0] == "step 2: complete"
    assert out.splitlines()[1].startswith(f"step 4: corrupt ({meta_path} is damaged: {problem}")
    code, _, err = train(capsys, "steps=5", f"save_dir={save_dir}", "resume=true")
    assert code == 0, err
    assert f"zinfjax: skipped step 4: corrupt ({meta_path} is damaged: {problem}" in err
    assert "moved step 4 (newer than step 2) aside" in err and "resuming from checkpoint" in err
    assert complete_steps(str(save_dir)) == [2, 5]


def test_4_resume_fails_in_one_line_when_no_checkpoint_is_whole(capsys, save_dir):
    for step in (2, 4):
        (save_dir / str(step) / "zinfjax.json").write_text("[]")
    message = one_error(*train(capsys, "steps=5", f"save_dir={save_dir}", "resume=true")[::2])
    assert message.startswith(f"resume=true: no complete checkpoint in {save_dir} (step 4: corrupt (")
    assert message.endswith("start a new run there with overwrite=true instead of resume (they are moved aside), or "
                            "choose another save_dir")


def test_4_a_corrupt_chunk_is_found_by_verify_and_skipped_by_resume(capsys, save_dir):
    leaf = save_dir / "4" / "opt_state" / "0.mu.blocks.fc.kernel"
    chunk = sorted(p for p in leaf.rglob("*") if p.is_file() and p.name != "zarr.json")[1]
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    where = chunk.relative_to(leaf).as_posix()
    code, out, _ = cli(capsys, "ckpt", "info", save_dir, "--verify")
    assert code == 1 and out.splitlines() == [
        "step 2: complete", f"step 4: corrupt (opt_state/0.mu.blocks.fc.kernel: chunk {where}: crc32c mismatch)",
        "1 of 2 complete; the newest complete is step 2"]
    message = one_error(*train(capsys, "steps=5", f"save_dir={save_dir}", "resume=4")[::2])
    assert message == (f"resume=4: step 4: corrupt (opt_state/0.mu.blocks.fc.kernel: chunk {where}: crc32c mismatch); "
                       f"choose another step (zinfjax ckpt info {save_dir} --verify lists the complete ones)")
    code, _, err = train(capsys, "steps=4", f"save_dir={save_dir}", "resume=true")
    assert code == 0 and "skipped step 4: corrupt (opt_state/0.mu.blocks.fc.kernel" in err
    assert cli(capsys, "ckpt", "info", save_dir, "--verify")[0] == 0  # step 4 saved again, whole


def test_4_a_leaf_claiming_a_billion_layers_is_corrupt_at_once_in_bounded_memory(save_dir):
    """zinfjax.json's sizes are checked against zarr.json before any loop is sized from them (a walk over
    the claimed chunk grid once built it whole: 36 GB of Python ints, found by test_fuzz in CI)."""
    meta_path = save_dir / "4" / "zinfjax.json"
    meta = json.loads(meta_path.read_text())
    meta["items"]["params"]["blocks.fc.kernel"]["shape"][0] = 10**9
    meta_path.write_text(json.dumps(meta))
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # 2 GiB of address space\n"
            "from zinfjax.checkpoint.verify import verify_save_dir\n"
            f"print([c.describe() for c in verify_save_dir({str(save_dir)!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(["step 2: complete", "step 4: corrupt (params/blocks.fc.kernel: zarr.json and "
                                      "zinfjax.json disagree on the shape, dtype or chunks)"])


# ---- 5. an unwritable log -------------------------------------------------------------------------------


def test_5_an_unwritable_log_is_refused_before_training(capsys, tmp_path):
    (tmp_path / "dir").mkdir()
    message = one_error(*train(capsys, "steps=2", f"log={tmp_path / 'dir'}", f"save_dir={tmp_path / 'ckpt'}")[::2])
    assert message == f"log={tmp_path / 'dir'} is a directory; give a file path, e.g. log={tmp_path / 'dir'}/run.json"
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        message = one_error(*train(capsys, "steps=2", f"log={ro / 'run.json'}", f"save_dir={tmp_path / 'ckpt'}")[::2])
        assert message == f"log={ro / 'run.json'} cannot be written (Read-only file system); choose a writable path"
    assert not (tmp_path / "ckpt").exists()  # refused before training: no checkpoint was written


# ---- 6. other tracebacks on bad input -------------------------------------------------------------------


@pytest.mark.parametrize("setting,message", [
    ("seed=-1", "seed=-1 must be between 0 and 2**63-1"),
    (f"seed={2**64 + 1}", f"seed={2**64 + 1} must be between 0 and 2**63-1"),
])
def test_6_seed_out_of_range(capsys, setting, message):
    assert one_error(*train(capsys, setting)[::2]) == message


def test_6_empty_token_file(capsys, tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    message = one_error(*train(capsys, f"data={tmp_path / 'empty.bin'}")[::2])
    assert message == f"token file '{tmp_path / 'empty.bin'}' is empty; a .bin file holds uint16 tokens"


def test_6_convert_with_a_malformed_config_json(capsys, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "gpt2",')
    (src / "model.safetensors").write_bytes(b"")
    message = one_error(*cli(capsys, "convert", src, tmp_path / "out", "--quiet")[::2])
    assert message.startswith(f"the Hugging Face config '{src / 'config.json'}' cannot be parsed: Expecting")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ds,message", [
    ({"zero_optimization": {"offload_param": {"device": "cpu", "buffer_size": "abc"}}},
     "ds.json: DeepSpeed zero_optimization.offload_param.buffer_size='abc' must be a whole number, 1 or more"),
    ({"zero_optimization": 5}, "ds.json: DeepSpeed zero_optimization must be a JSON object of keys and values, not 5"),
])
def test_6_deepspeed_config_of_the_wrong_types(capsys, tmp_path, ds, message):
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    assert one_error(*train(capsys, config=str(tmp_path / "ds.json"))[::2]) == f"{tmp_path}/{message}"


def test_6_prompt_ids_that_are_not_numbers(capsys, run_a):
    message = one_error(*cli(capsys, "generate", run_a, "--prompt-ids", "1,x,3")[::2])
    assert message == ("--prompt-ids '1,x,3': 'x' is not a token id; give comma-separated integers, e.g. "
                       "--prompt-ids 72,105")


def test_6_a_reader_that_leaves_early_is_no_error(run_a):
    read, write = os.pipe()
    os.close(read)  # `zinfjax ckpt info D | head` after head has exited
    proc = subprocess.run([sys.executable, "-m", "zinfjax.cli", "ckpt", "info", str(run_a)], cwd=REPO, stdout=write,
                          stderr=subprocess.PIPE, text=True)
    os.close(write)
    assert proc.stderr == "" and proc.returncode == 128 + signal.SIGPIPE


# ---- 7. inconsistent state left behind ------------------------------------------------------------------


def test_7_a_failed_export_leaves_nothing_and_a_rerun_works(capsys, run_a, tmp_path):
    with tmpfs(tmp_path / "small", "256k") as small:
        message = one_error(*cli(capsys, "ckpt", "export", run_a, small / "out")[::2])
        assert message.startswith(f"cannot export {run_a}/4 to {small / 'out'}: ")
        assert message.endswith("; nothing was left there")
        assert os.listdir(small) == []
    code, out, err = cli(capsys, "ckpt", "export", run_a, tmp_path / "small" / "out")  # the same path, with room
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "small")) == ["out"]


def test_7_an_interrupted_prune_never_leaves_a_listed_partial_step(save_dir):
    """A prune renames the step out of the namespace first; here the deletion after it is cut short."""
    child = [sys.executable, "-m", "tests.support.checkpoint_child", "kill-in-prune", str(save_dir)]
    proc = subprocess.run(child, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    found = {c.name: c.state for c in verify_save_dir(str(save_dir))}
    deleting = [n for n in found if n.startswith(".deleting-2-")]
    assert complete_steps(str(save_dir)) == [4, 5] and len(deleting) == 1
    assert found == {"4": "complete", "5": "complete", deleting[0]: "partial"}
    CheckpointManager(str(save_dir)).close()  # the next run clears it
    assert sorted(os.listdir(save_dir)) == ["4", "5"]


# ---- 8. bad values accepted silently --------------------------------------------------------------------


@pytest.mark.parametrize("setting,message", [
    ("lr=.inf", "lr=inf must be a positive, finite number, e.g. 3e-4"),
    ("steps=true", "steps=True is not a valid int"),
    ("weight_decay=-1", "weight_decay=-1.0 must be 0 (off) or a positive, finite number"),
])
def test_8_bad_values_are_refused(capsys, setting, message):
    assert one_error(*train(capsys, setting)[::2]) == message


def test_8_negative_new_tokens(capsys, run_a):
    message = one_error(*cli(capsys, "generate", run_a, "--prompt", "Hi", "--max-new-tokens", "-3")[::2])
    assert message == "--max-new-tokens -3 must be 1 or more"


def test_8_duplicate_yaml_keys(capsys, tmp_path):
    (tmp_path / "run.yaml").write_text("steps: 3\nlr: 0.001\nsteps: 30\n")
    message = one_error(*train(capsys, config=str(tmp_path / "run.yaml"))[::2])
    assert message == f"config file '{tmp_path / 'run.yaml'}' cannot be parsed: key 'steps' is given twice " \
                      "(lines 1 and 3); keep one"
