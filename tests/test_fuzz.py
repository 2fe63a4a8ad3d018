"""Property tests: any config value, DeepSpeed config or checkpoint metadata gives a `UserError` or works.

Never another exception: that would be a traceback for the user. Hypothesis draws the input; the
budget is bounded (``max_examples``) to keep the suite fast.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from zinfjax import Config, models
from zinfjax.checkpoint import CheckpointSource, inspect
from zinfjax.checkpoint.model import checkpoint_model
from zinfjax.checkpoint.resume import choose_start
from zinfjax.cli import main
from zinfjax.errors import UserError
from zinfjax.models import ModelConfig
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax.trainers.streaming import lm_program

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TINY = dict(model="gpt2-tiny", batch_size=2, seq_len=16, mesh="data:1")

SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-3, 3) | st.floats() | st.text(max_size=12)
           | st.sampled_from(["nvme", "host", "device", "fp16", "bf16", "adamw", "sgd", "data:2", "gpt2-tiny", "64MiB",
                              "1e-3", ".inf", "true", "/tmp/zinfjax-fuzz"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
CONFIG_KEYS = [f.name for f in dataclasses.fields(Config)]


def only_user_errors(fn, *args, **kwargs) -> None:
    """Calls ``fn``; a one-line `UserError` is an accepted answer, any other exception fails the test."""
    try:
        fn(*args, **kwargs)
    except UserError as e:
        assert str(e) and "\n" not in str(e), repr(e)


# ---- config values ------------------------------------------------------------------------------


@SETTINGS
@given(st.dictionaries(st.sampled_from([*CONFIG_KEYS, "unknown_key"]) | st.text(max_size=6) | st.integers(), JSON,
                       max_size=6))
def test_any_config_mapping_gives_a_config_or_a_user_error(values):
    only_user_errors(Config.from_dict, values)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([*CONFIG_KEYS, "", " stage", "x"]), st.text(max_size=20)), max_size=4))
def test_any_set_override_gives_a_config_or_a_user_error(pairs):
    only_user_errors(Config.load, None, [f"{key}={raw}" for key, raw in pairs])


DS_KEYS = ["stage", "offload_param", "offload_optimizer", "device", "nvme_path", "buffer_count", "buffer_size",
           "pin_memory", "enabled", "type", "params", "lr", "weight_decay", "betas", "eps", "overlap_comm"]
DS_SECTIONS = st.recursive(SCALARS | st.sampled_from(["cpu", "none", "Adam", "AdamW"]),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(DS_KEYS) | st.text(max_size=5), inner, max_size=4),
                           max_leaves=10)
DS_CONFIGS = st.fixed_dictionaries(
    {"zero_optimization": DS_SECTIONS},
    optional={k: DS_SECTIONS for k in ("bf16", "fp16", "optimizer", "gradient_clipping", "gradient_accumulation_steps",
                                       "train_micro_batch_size_per_gpu", "steps_per_print", "flops_profiler")})


@SETTINGS
@given(ds=DS_CONFIGS)
def test_any_deepspeed_config_gives_a_config_or_a_user_error(tmp_path, ds):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    only_user_errors(Config.from_file, str(path))


# ---- checkpoint metadata ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real checkpoint of one step, and its metadata."""
    save_dir = tmp_path_factory.mktemp("fuzz") / "ckpt"
    sets = [f"{k}={v}" for k, v in {**TINY, "steps": 1, "save_dir": save_dir}.items()]
    assert main(["train", "--quiet", *[a for s in sets for a in ("--set", s)]]) == 0
    with open(save_dir / "1" / "zinfjax.json") as f:
        return save_dir, json.load(f)


def _paths(tree, prefix=()):
    """Every key path into a JSON tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@st.composite
def damaged(draw, meta: dict):
    """``meta`` with one to three keys deleted or their values replaced by any JSON."""
    meta = copy.deepcopy(meta)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(meta))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = meta
        for k in path[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON | st.integers(-(2**70), 2**70))
    return meta


def every_reader(save_dir, out) -> None:
    """Every reader of zinfjax.json: ckpt info (text, JSON, --verify), inference, resume, fresh run, restore, export."""
    model = ModelConfig.named("gpt2-tiny")
    only_user_errors(inspect.info_text, save_dir)
    only_user_errors(inspect.info_text, save_dir, as_json=True)
    only_user_errors(inspect.verify_text, save_dir)
    only_user_errors(checkpoint_model, save_dir)
    only_user_errors(choose_start, Config(save_dir=save_dir, resume=True, **TINY), model)
    only_user_errors(choose_start, Config(save_dir=save_dir, **TINY), model)
    program, plan = lm_program(models.build(model), Config(**TINY), make_optimizer(Config(**TINY)))
    only_user_errors(CheckpointSource, save_dir, program, plan)
    only_user_errors(inspect.export_params, save_dir, out)
    shutil.rmtree(out, ignore_errors=True)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_to_zinfjax_json_gives_a_user_error_at_most(trained, tmp_path, data):
    source, meta = trained
    save_dir = tmp_path / "ckpt"
    if not save_dir.exists():
        shutil.copytree(source, save_dir)
    content = data.draw(st.one_of(damaged(meta).map(json.dumps), JSON.map(json.dumps), st.binary(max_size=64)),
                        label="zinfjax.json")
    mode = "wb" if isinstance(content, bytes) else "w"
    with open(save_dir / "1" / "zinfjax.json", mode) as f:
        f.write(content)
    every_reader(str(save_dir), str(tmp_path / "out"))


def test_the_undamaged_checkpoint_passes_every_reader(trained, tmp_path):
    """The property above would hold vacuously if the readers refused even a whole checkpoint."""
    source, _ = trained
    assert inspect.verify_text(str(source))[1]
    assert checkpoint_model(str(source))[1] == ModelConfig.named("gpt2-tiny")
    assert choose_start(Config(save_dir=str(source), resume=True, **TINY), ModelConfig.named("gpt2-tiny")).step == 1
    assert inspect.export_params(str(source), str(tmp_path / "out"))["leaves"] > 0
