"""DeepSpeed ZeRO checkpoints to zinfjax, against checkpoints that real DeepSpeed writes here.

Two DeepSpeed ranks (gloo, on the CPU; tests/support/deepspeed_child.py) train a tiny GPT-2 with AdamW at
ZeRO-1 bf16 (DeepSpeed's BF16_Optimizer), ZeRO-2 bf16 and ZeRO-3 fp32, and save a checkpoint. The
converted fp32 master weights and Adam moments must equal, bit for bit, what DeepSpeed itself
reports: its own consolidation (zero_to_fp32) and the live engine's full state
(safe_get_full_fp32_param, safe_get_full_optimizer_state). Then zinfjax trains on from the
converted checkpoint; in fp32 its next step matches DeepSpeed's next step: no farther from that step taken in
float64 (the in-memory optax step under ``jax.enable_x64`` from the converted state) than DeepSpeed's is
(tests/support/tolerances.py).

Synthetic ZeRO-2 checkpoints (plain dicts, written here) check the errors, fast.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import math
import os
import shutil
import sys
import types
from collections import OrderedDict

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model here is local: a download attempt is a bug

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import safetensors.numpy  # noqa: E402
import tensorstore as ts  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from tests.support import deepspeed_child as child  # noqa: E402
from tests.support.engine_helpers import relative_error  # noqa: E402
from tests.support.tolerances import assert_loss_no_farther, assert_no_farther  # noqa: E402
from zinfjax import Config, models  # noqa: E402
from zinfjax.checkpoint import CheckpointSource, read_meta  # noqa: E402
from zinfjax.checkpoint.snapshot import leaf_name  # noqa: E402
from zinfjax.models.stacked import lm_loss  # noqa: E402
from zinfjax.sharding import make_mesh, path_str  # noqa: E402
from zinfjax.trainers.optimizers import make_optimizer  # noqa: E402
from zinfjax.trainers.reference import make_step  # noqa: E402
from zinfjax.trainers.streaming import lm_engine  # noqa: E402
from zinfjax_interop import (  # noqa: E402
    CheckpointFilesError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    load_hf,
)
from zinfjax_interop.deepspeed import UnsupportedCheckpointError, UnsupportedOptimizerError, convert_deepspeed  # noqa: E402
from zinfjax_interop.ds_adam import AdamSettings, adam_settings  # noqa: E402
from zinfjax_interop.hf import save_hf, zinfjax_shapes  # noqa: E402
from zinfjax_interop.hf_config import from_hf_config  # noqa: E402

RUNS = {"zero1-bf16": (1, "bf16"), "zero2-bf16": (2, "bf16"), "zero3-fp32": (3, "fp32")}
WORLD = 2

# ---- the DeepSpeed runs --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    """Every run of RUNS, trained and saved by two DeepSpeed ranks (one launch, ~25 s on 2 CPU cores)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("DeepSpeed is not installed: pip install -e '.[dev]'")
    out = tmp_path_factory.mktemp("deepspeed")
    child.launch(out, [f"{name}:{stage}:{dtype}" for name, (stage, dtype) in RUNS.items()], WORLD)
    return out


def reference(run_dir) -> dict:
    return torch.load(os.path.join(run_dir, "reference.pt"), weights_only=True)


# ---- reading the converted checkpoint back in HF names -----------------------------------------------


def read_leaf(path: str, item: str, name: str) -> np.ndarray:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, item, name)}}
    return ts.open(spec, open=True, read=True).result().read().result()


def as_hf(path: str, model, tmp_path, item: str = "params", prefix: str = "") -> dict[str, np.ndarray]:
    """A converted checkpoint's params (or optax moments: item opt_state, prefix "0.mu.") under HF's names.

    The way back is `save_hf`, which writes every tensor of a zinfjax tree bit for bit
    (tests/interop/test_hf.py), so the comparison does not reuse the converter's own mapping.
    """
    flat = {}
    for p in zinfjax_shapes(model):
        flat[tuple(p.split("/"))] = read_leaf(path, item, f"{prefix}{p.replace('/', '.')}")
    out = tmp_path / f"hf-{item}-{prefix or 'w'}"
    save_hf(_unflatten(flat), model, str(out))
    return safetensors.numpy.load_file(str(out / "model.safetensors"))


def _unflatten(flat: dict[tuple, np.ndarray]) -> dict:
    tree: dict = {}
    for keys, value in flat.items():
        node = tree
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return tree


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# ---- exactness -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_weights_and_adam_moments_equal_deepspeeds_exactly(ds_runs, run, tmp_path):
    src = ds_runs / run
    ref = reference(src)
    summary = convert_deepspeed(str(src), str(tmp_path / "zinfjax"))
    stage, dtype = RUNS[run]
    assert ref["global_steps"] == child.STEPS == 3
    assert (summary["stage"], summary["world_size"], summary["step"], summary["adam_step"]) == (stage, WORLD, 3, 3)
    assert summary["precision"] == dtype and summary["path"] == str(tmp_path / "zinfjax" / "3")
    model = from_hf_config(transformers.GPT2Config.from_pretrained(src).to_dict())
    weights = as_hf(summary["path"], model, tmp_path)
    moments = {k: as_hf(summary["path"], model, tmp_path, "opt_state", f"0.{m}.")
               for k, m in (("exp_avg", "mu"), ("exp_avg_sq", "nu"))}
    consolidated = ref["zero_to_fp32"]
    if run == "zero1-bf16":  # DeepSpeed's own zero_to_fp32 cannot read its BF16_Optimizer checkpoints
        assert "is not a zero checkpoint" in consolidated
    diffs = {}
    for name, state in ref["state"].items():
        if name == "lm_head.weight":  # tied to transformer.wte.weight
            continue
        np.testing.assert_array_equal(weights[name], state["fp32"].numpy(), err_msg=name)
        if isinstance(consolidated, dict):
            np.testing.assert_array_equal(weights[name], consolidated[name].numpy(), err_msg=name)
        for k in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(moments[k][name], state[k].numpy(), err_msg=f"{name} {k}")
            diffs[k] = max(diffs.get(k, 0.0), max_abs_diff(moments[k][name], state[k]))
        diffs["fp32"] = max(diffs.get("fp32", 0.0), max_abs_diff(weights[name], state["fp32"]))
    assert set(weights) == {n for n in ref["state"] if n != "lm_head.weight"}
    assert diffs == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    np.testing.assert_array_equal(read_leaf(summary["path"], "opt_state", "0.count"), np.int32(3))
    meta = read_meta(summary["path"])
    assert (meta["step"], meta["data_position"]) == (3, 3)
    assert meta["config"]["lr"] == child.LR and meta["config"]["weight_decay"] == child.WEIGHT_DECAY
    assert meta["config"]["stage"] == stage and meta["model"]["d_model"] == 27


@pytest.mark.slow
def test_zinfjax_convert_takes_a_deepspeed_run_to_zinfjax_and_to_hf(ds_runs, tmp_path, capsys):
    from zinfjax.cli import main

    src = ds_runs / "zero2-bf16"
    ref = reference(src)
    assert main(["convert", str(src), str(tmp_path / "zinfjax"), "--quiet", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["format"], out["to"], out["step"]) == ("deepspeed", "zinfjax", 3)
    assert read_meta(out["path"])["model"]["d_model"] == 27
    assert main(["convert", str(src), str(tmp_path / "hf"), "--to", "hf", "--quiet", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["format"], out["to"], out["dtype"]) == ("deepspeed", "hf", "float32")
    exported = safetensors.numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(exported) == sorted(n for n in ref["state"] if n != "lm_head.weight")
    for name, array in exported.items():  # DeepSpeed's fp32 master weights, as transformers names them
        np.testing.assert_array_equal(array, ref["state"][name]["fp32"].numpy(), err_msg=name)
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")) is not None
    assert not os.path.exists(tmp_path / "hf" / ".deepspeed-staging")


def restore_config(path: str, precision: str) -> Config:
    """The run that trains on from the converted checkpoint, with the optimizer it records."""
    meta = read_meta(path)
    return Config(mesh="data:1", batch_size=WORLD * child.MICRO_BATCH, seq_len=child.SEQ, precision=precision,
                  lr=meta["config"]["lr"], weight_decay=meta["config"]["weight_decay"], optimizer_name="adamw")


def restore(path: str, model, precision: str):
    """An engine started from the converted checkpoint, with the optimizer it records."""
    c = restore_config(path, precision)
    made = []

    def source(program, plan):
        made.append(CheckpointSource(os.path.dirname(path), program, plan))
        return made[0]

    engine = lm_engine(models.build(model), c, make_mesh(c.mesh_axes()), source=source)
    return engine, made[0]


def optax_step(path: str, model, batch, dtype=jnp.float32):
    """The loss and the params after one step from the converted checkpoint (params and Adam state), taken by the
    in-memory optax step; in float64, the truth an fp32 step is judged against (tests/support/tolerances.py)."""
    tx = make_optimizer(restore_config(path, "fp32"))
    with jax.enable_x64(dtype == jnp.float64):
        params = {}
        for p in zinfjax_shapes(model):
            *keys, last = p.split("/")
            node = params
            for k in keys:
                node = node.setdefault(k, {})
            node[last] = read_leaf(path, "params", leaf_name(p)).astype(dtype)
        state = jax.tree_util.tree_map_with_path(
            lambda q, x: read_leaf(path, "opt_state", leaf_name(path_str(q))).astype(x.dtype), tx.init(params))
        step = make_step(lm_loss(models.build(model, dtype)), tx, make_mesh({"data": 1}))
        params, _, loss = step(jax.device_put(params), jax.device_put(state), batch)
        assert loss.dtype == dtype and all(x.dtype == dtype for x in jax.tree.leaves(params))  # no silent cast
        return float(loss), jax.tree.map(np.asarray, params)


def as_zinfjax(tensors: dict, src, directory) -> dict:
    """Tensors under HF's names (DeepSpeed's) as a zinfjax parameter tree, read back by `load_hf`."""
    os.makedirs(directory)
    shutil.copy(os.path.join(src, "config.json"), directory)
    safetensors.numpy.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return load_hf(str(directory))[1]


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.parametrize("run", ["zero2-bf16", "zero3-fp32"])
def test_training_continues_in_zinfjax(ds_runs, run, tmp_path):
    """Two more steps from DeepSpeed's step 3; in fp32 the first is DeepSpeed's own next step."""
    src = ds_runs / run
    ref = reference(src)
    path = convert_deepspeed(str(src), str(tmp_path / "zinfjax"))["path"]
    model = from_hf_config(transformers.GPT2Config.from_pretrained(src).to_dict())
    engine, source = restore(path, model, RUNS[run][1])
    try:
        assert source.step == engine.step_count == 3
        batch = ref["batch"].numpy().astype(np.int32)
        losses = [engine.train_step(batch)["loss"]]
        after = jax.tree.map(np.asarray, engine.params())
        losses.append(engine.train_step(batch)["loss"])
        assert engine.step_count == 5 and all(math.isfinite(x) for x in losses)
    finally:
        engine.close()
    if RUNS[run][1] != "fp32":
        return
    exact_loss, exact = optax_step(path, model, batch, jnp.float64)
    _, in_memory = optax_step(path, model, batch)
    # Its loss no farther from the loss in float64 than DeepSpeed's (the mean over the batch's tokens). Its params,
    # and DeepSpeed's, no farther from the step in float64 than the in-memory optax step in fp32 is (whole-tree
    # relative L2, less GPT-2's key bias, whose true gradient is zero: Adam turns its rounding noise into full steps).
    # One step from the same state leaves all three within a unit or two of fp32 of the exact params, where
    # DeepSpeed's CPU Adam, which orders its arithmetic otherwise, is no reference for optax's.
    assert_loss_no_farther(exact_loss, ref["loss"], losses[0], terms=batch[:, 1:].size)
    out = tmp_path / "after"
    save_hf(after, model, str(out))
    names = safetensors.numpy.load_file(str(out / "model.safetensors"))
    theirs = as_zinfjax({n: ref["after"][n].numpy() for n in names}, src, tmp_path / "deepspeed-after")
    assert_no_farther(exact, in_memory, after, relative_error)
    assert_no_farther(exact, in_memory, theirs, relative_error)


# ---- synthetic checkpoints: the errors ---------------------------------------------------------------


def tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=11, n_positions=8, n_embd=6, n_layer=1, n_head=2, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    # named_parameters leaves out the tied lm_head.weight, as DeepSpeed's param_shapes do
    return cfg, {n: p.detach().clone() for n, p in transformers.GPT2LMHeadModel(cfg).named_parameters()}


def fake_zero2(directory, params: dict[str, torch.Tensor], world: int = 2, step: int = 5, group: dict | None = None,
               cfg=None, state: dict | None = None, ds_config: dict | None = None):
    """A ZeRO-2 checkpoint as DeepSpeed lays it out, from plain dicts: one group, ``world`` ranks."""
    tag = directory / "global_step5"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("global_step5")
    if cfg is not None:
        cfg.save_pretrained(directory)
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    align = 2 * world
    padded = torch.cat([flat, torch.zeros(-len(flat) % align)])
    size = len(padded) // world
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False, "params": [0],
             **(group or {})}
    for r in range(world):
        part = padded[r * size:(r + 1) * size]
        pad = len(padded) - len(flat) if r == world - 1 else 0
        adam = {"step": torch.tensor(float(step)), "exp_avg": part * 0.5, "exp_avg_sq": part * part}
        saved = {"zero_stage": 2, "partition_count": [world], "group_paddings": [pad],
                 "single_partition_of_fp32_groups": [part[:size - pad].clone()],
                 "base_optimizer_state": {"state": {0: adam}, "param_groups": [group]}, **(state or {})}
        torch.save({"optimizer_state_dict": saved, "ds_config": ds_config or {"zero_optimization": {"stage": 2}}},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    shapes = OrderedDict((n, p.shape) for n, p in params.items())
    torch.save({"module": {}, "param_shapes": [shapes], "buffer_names": [], "shared_params": {},
                "global_steps": step}, tag / "mp_rank_00_model_states.pt")
    return directory


def test_synthetic_zero2_converts_exactly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # the converter never imports DeepSpeed: an import fails
    cfg, params = tiny_gpt2()
    src = fake_zero2(tmp_path / "ds", params, world=3, cfg=cfg)
    summary = convert_deepspeed(str(src), str(tmp_path / "out"))
    assert (summary["step"], summary["stage"], summary["world_size"], summary["adam_step"]) == (5, 2, 3, 5)
    model = from_hf_config(cfg.to_dict())
    weights = as_hf(summary["path"], model, tmp_path)
    mu = as_hf(summary["path"], model, tmp_path, "opt_state", "0.mu.")
    for name, p in params.items():
        np.testing.assert_array_equal(weights[name], p.numpy())
        np.testing.assert_array_equal(mu[name], p.numpy() * 0.5)
    # A model that wraps the HF model (module.transformer.h.0...) converts the same.
    wrapped = fake_zero2(tmp_path / "wrapped", {f"module.{n}": p for n, p in params.items()}, world=3, cfg=cfg)
    again = as_hf(convert_deepspeed(str(wrapped), str(tmp_path / "out2"))["path"], model, tmp_path / "again")
    for name in params:
        np.testing.assert_array_equal(again[name], weights[name])


def fake_module(monkeypatch, path: str, obj) -> None:
    """Makes ``obj`` picklable as ``path`` (a DeepSpeed class) without importing DeepSpeed."""
    module, name = path.rsplit(".", 1)
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix not in sys.modules:
            monkeypatch.setitem(sys.modules, prefix, types.ModuleType(prefix))
    obj.__module__, obj.__qualname__ = module, name
    monkeypatch.setattr(sys.modules[module], name, obj, raising=False)


def test_fp16_checkpoint_with_deepspeed_classes_in_its_pickles(tmp_path, monkeypatch):
    """fp16 (DeepSpeed's CPU accelerator has none, so written here): its enum and loss scaler, read inertly."""

    class ZeroStageEnum(int, enum.Enum):
        disabled, optimizer_states, gradients, weights = 0, 1, 2, 3

    class DynamicLossScaler:
        def __init__(self):
            self.cur_scale, self.cur_iter = 1024.0, 7

    fake_module(monkeypatch, "deepspeed.runtime.zero.config.ZeroStageEnum", ZeroStageEnum)
    fake_module(monkeypatch, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", DynamicLossScaler)
    cfg, params = tiny_gpt2()
    src = fake_zero2(tmp_path / "ds", params, cfg=cfg, ds_config={"fp16": {"enabled": True}, "gradient_clipping": 1.0},
                     state={"zero_stage": ZeroStageEnum.gradients, "loss_scaler": DynamicLossScaler()})
    summary = convert_deepspeed(str(src), str(tmp_path / "out"))
    assert (summary["stage"], summary["precision"]) == (2, "fp16")
    assert read_meta(summary["path"])["config"]["grad_clip"] == 1.0
    weights = as_hf(summary["path"], from_hf_config(cfg.to_dict()), tmp_path)
    for name, p in params.items():
        np.testing.assert_array_equal(weights[name], p.numpy())


def test_missing_rank_file_is_named(tmp_path):
    cfg, params = tiny_gpt2()
    src = fake_zero2(tmp_path / "ds", params, world=3, cfg=cfg)
    os.remove(src / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointFilesError, match="3 data-parallel ranks, but lacks zero_pp_rank_1_mp_rank_00_optim"):
        convert_deepspeed(str(src), str(tmp_path / "out"))
    os.remove(src / "global_step5" / "mp_rank_00_model_states.pt")
    shutil.copy(src / "global_step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                src / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointFilesError, match="lacks mp_rank_00_model_states.pt"):
        convert_deepspeed(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "5")


def test_unknown_and_missing_tensors_are_named(tmp_path):
    cfg, params = tiny_gpt2()
    src = fake_zero2(tmp_path / "a", params | {"transformer.h.0.adapter.weight": torch.ones(3)}, cfg=cfg)
    with pytest.raises(UnexpectedTensorError, match=r"transformer\.h\.0\.adapter\.weight"):
        convert_deepspeed(str(src), str(tmp_path / "out"))
    less = {n: p for n, p in params.items() if n != "transformer.ln_f.bias"}
    with pytest.raises(MissingTensorError, match=r"lacks 1 tensor: transformer\.ln_f\.bias"):
        convert_deepspeed(str(fake_zero2(tmp_path / "b", less, cfg=cfg)), str(tmp_path / "out"))
    untied = fake_zero2(tmp_path / "c", params | {"lm_head.weight": torch.ones(11, 6)}, cfg=cfg)
    with pytest.raises(UnexpectedTensorError, match=r"lm_head\.weight trained by DeepSpeed"):
        convert_deepspeed(str(untied), str(tmp_path / "out"))


def test_shape_mismatch_is_named(tmp_path):
    cfg, params = tiny_gpt2()
    src = fake_zero2(tmp_path / "ds", params)
    wider = from_hf_config({**cfg.to_dict(), "n_inner": 12})
    with pytest.raises(ShapeMismatchError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight has shape \(6, 24\)"):
        convert_deepspeed(str(src), str(tmp_path / "out"), wider)
    with pytest.raises(CheckpointFilesError, match="no config.json beside"):
        convert_deepspeed(str(src), str(tmp_path / "out"))


@pytest.mark.parametrize("group, message", [
    ({"betas": (0.9, 0.95)}, r"betas=\(0\.9, 0\.95\)"),
    ({"eps": 1e-6}, "eps=1e-06"),
    ({"amsgrad": True}, "amsgrad=True"),
    ({"weight_decay": 0.1, "decoupled_weight_decay": False}, "L2 weight decay"),
])
def test_unsupported_optimizer_is_refused(tmp_path, group, message):
    cfg, params = tiny_gpt2()
    src = fake_zero2(tmp_path / "ds", params, group=group, cfg=cfg)
    with pytest.raises(UnsupportedOptimizerError, match=f"parameter group 0: {message}"):
        convert_deepspeed(str(src), str(tmp_path / "out"))


def test_other_optimizers_are_refused(tmp_path):
    cfg, params = tiny_gpt2()
    sgd = {"lr": 0.1, "momentum": 0.9, "dampening": 0, "nesterov": False, "weight_decay": 0.0, "params": [0]}
    for name, state in (("sgd", {0: {"momentum_buffer": torch.zeros(3)}}), ("sgd-before-step", {})):
        src = fake_zero2(tmp_path / name, params, cfg=cfg,
                         state={"base_optimizer_state": {"state": state, "param_groups": [sgd]}})
        message = "holds momentum_buffer, not Adam's exp_avg" if state else "not an Adam optimizer .*momentum"
        with pytest.raises(UnsupportedOptimizerError, match=message):
            convert_deepspeed(str(src), str(tmp_path / "out"))
    lamb = fake_zero2(tmp_path / "lamb", params, cfg=cfg, ds_config={"optimizer": {"type": "Lamb"}})
    with pytest.raises(UnsupportedOptimizerError, match="DeepSpeed optimizer 'Lamb'"):
        convert_deepspeed(str(lamb), str(tmp_path / "out"))


def test_groups_that_differ_need_a_choice():
    """HF's Trainer puts biases and norms in a group without weight decay; zinfjax has one weight decay."""
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd, "decoupled_weight_decay": True,
               "params": [i]} for i, wd in enumerate((0.1, 0.0))]
    with pytest.raises(UnsupportedOptimizerError, match=r"weight_decay \[0\.0, 0\.1\].*pass weight_decay="):
        adam_settings(groups, {}, "ckpt")
    assert adam_settings(groups, {}, "ckpt", weight_decay=0.1) == AdamSettings(1e-3, 0.1)


class Payload:
    """Stands for arbitrary code in a pickle: torch.load(weights_only=True) must refuse it."""

    def __reduce__(self):
        return (os.system, ("echo unpickled",))


def test_unsafe_pickles_and_other_parallelisms_are_refused(tmp_path):
    cfg, params = tiny_gpt2()
    src = fake_zero2(tmp_path / "ds", params, cfg=cfg)
    model_states = src / "global_step5" / "mp_rank_00_model_states.pt"
    saved = torch.load(model_states, weights_only=True)
    torch.save({**saved, "args": Payload()}, model_states)
    with pytest.raises(CheckpointFilesError, match=r"mp_rank_00_model_states\.pt holds a .*system, which zinfjax "
                                                   r"does not unpickle"):
        convert_deepspeed(str(src), str(tmp_path / "out"))
    shutil.copy(src / "global_step5" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                src / "global_step5" / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with pytest.raises(UnsupportedCheckpointError, match="tensor-parallel"):
        convert_deepspeed(str(src), str(tmp_path / "out"))
