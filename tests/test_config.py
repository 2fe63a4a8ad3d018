import dataclasses
import json

import pytest

from zinfjax import Config, ConfigError
from zinfjax.config import parse_mesh
from zinfjax.errors import UserError
from zinfjax.sections import SECTIONS, EngineSettings, Memory, Numerics, Tiering


def test_defaults_are_valid_and_keys_are_the_public_contract():
    c = Config()
    for key in ("stage", "params", "optimizer", "gradients", "activations", "nvme_path", "prefetch_depth",
                "host_buffer_bytes", "precision", "grad_clip", "grad_accum", "mesh", "model", "steps",
                "batch_size", "seq_len", "lr", "seed", "log"):
        assert key in c.to_dict()


def test_every_key_is_in_one_section_under_its_name_type_and_default():
    keys = {f.name: f for f in dataclasses.fields(Config)}
    placed = [f.name for section in SECTIONS for f in dataclasses.fields(section)]
    assert sorted(placed) == sorted(keys), "each Config key belongs to exactly one section of zinfjax.sections"
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert (f.type, f.default) == (keys[f.name].type, keys[f.name].default), f"{section.__name__}.{f.name}"


def test_sections_are_the_configs_keys_as_given_and_leave_it_flat(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"memory_limit: 2GiB\noptimizer: host:3,nvme\nnvme_path: {tmp_path}\nprecision: bf16\n")
    c = Config.load(str(path), ["seed=7", "update_on=host"])
    assert c.section(Memory) == Memory(memory_limit=2 << 30)
    assert c.section(Tiering) == Tiering(optimizer="host:3,nvme", nvme_path=str(tmp_path), update_on="host")
    assert c.engine_settings() == EngineSettings(c.section(Tiering), c.section(Memory), Numerics("bf16"), seed=7)
    assert c.section(Tiering).uses_nvme and c.uses_nvme and not Config().section(Tiering).uses_nvme
    merged = {k: v for section in SECTIONS for k, v in c.section(section).to_dict().items()}
    assert merged == c.to_dict() and Config.from_dict(merged) == c  # the flat keys, unchanged
    assert c.engine_settings().to_dict() == {k: c.to_dict()[k] for k in c.engine_settings().to_dict()}
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.section(Memory).prefetch_depth = 2


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("stage: 2\nmodel: llama-tiny\nhost_buffer_bytes: 256MiB\n")
    c = Config.load(str(path), ["steps=7", "lr=1e-3", "params=nvme", f"nvme_path={tmp_path}", "log="])
    assert (c.stage, c.model, c.steps, c.lr, c.params) == (2, "llama-tiny", 7, 1e-3, "nvme")
    assert c.host_buffer_bytes == 256 * 2**20 and c.log is None


def test_json_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"stage": 1, "mesh": "data:4,model:2"}))
    c = Config.from_file(str(path))
    assert c.stage == 1 and c.mesh_axes() == {"data": 4, "model": 2}


@pytest.mark.parametrize("override,message", [
    ("stage=5", "use 0, 1, 2 or 3"),
    ("params=disk", "use one of device, host, nvme"),
    ("precision=fp8", "fp32, bf16, fp16"),
    ("optimizer=nvme", "nvme_path is not set"),
    ("grad_accum=0", "1 or more"),
    ("mesh=data:x", "name:size"),
    ("steps=ten", "not a valid int"),
    ("host_buffer_bytes=lots", "not a byte size"),
    ("nokey=1", "unknown key"),
    ("stage", "key=value"),
])
def test_invalid_values_say_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        Config.load(None, [override])


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.from_file(str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        Config.from_file(str(bad))


def test_deepspeed_config_is_mapped(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "betas": [0.9, 0.999]}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5,
                              "buffer_size": 1e8, "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    c = Config.from_file(str(path))
    assert (c.stage, c.params, c.optimizer, c.nvme_path) == (3, "nvme", "host", str(tmp_path))
    assert (c.micro_batch_size, c.grad_accum, c.grad_clip, c.precision) == (4, 2, 1.0, "bf16")
    assert c.batch_size == 0 and c.with_batch_for(2).batch_size == 4 * 2 * 2  # micro x accumulation x data
    assert (c.optimizer_name, c.lr, c.weight_decay, c.prefetch_depth) == ("adamw", 1e-4, 0.1, 4)
    assert c.host_buffer_bytes == 2 * 10**8 * 5


def test_deepspeed_unsupported_keys_are_all_listed(tmp_path):
    ds = {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8, "mics_shard_size": 2},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}},
          "flops_profiler": {}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ConfigError) as err:
        Config.from_file(str(path))
    for key in ("zero_optimization.zero_hpz_partition_size", "zero_optimization.mics_shard_size",
                "optimizer.params.betas", "flops_profiler"):
        assert key in str(err.value)


def test_parse_mesh():
    assert parse_mesh("data:-1") == {"data": -1}
    with pytest.raises(ConfigError):
        parse_mesh("data:-1,model:-1")


def test_model_is_a_named_size_a_model_file_or_a_checkpoint(tmp_path):
    import dataclasses

    import yaml

    from zinfjax.checkpoint.model import resolve_model
    from zinfjax.models import NAMED, ModelConfig

    mini = dataclasses.asdict(NAMED["gpt2-mini"].replace(n_layers=3))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(mini))
    assert ModelConfig.resolve(str(tmp_path / "model.yaml")) == NAMED["gpt2-mini"].replace(n_layers=3)
    assert Config.load(None, [f"model={tmp_path / 'model.yaml'}"]).model == str(tmp_path / "model.yaml")

    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**mini, "n_layer": 3}))
    with pytest.raises(ConfigError, match=r"unknown ModelConfig field\(s\) n_layer; known: arch, d_ff"):
        resolve_model(str(tmp_path / "bad.yaml"))
    (tmp_path / "arch.yaml").write_text(yaml.safe_dump({**mini, "arch": "mamba"}))
    with pytest.raises(ConfigError, match="arch 'mamba' is not one of gpt2, llama, bert"):
        ModelConfig.resolve(str(tmp_path / "arch.yaml"))
    with pytest.raises(ConfigError, match="unknown model 'gpt5'; choose one of gpt2-tiny.*or a zinfjax checkpoint"):
        resolve_model("gpt5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no complete checkpoint|holds no checkpoint|no checkpoint"):
        resolve_model(str(tmp_path / "empty"))


@pytest.mark.parametrize("override,message", [
    ("seed=-1", r"seed=-1 must be between 0 and 2\*\*63-1"),
    (f"seed={2**65}", r"must be between 0 and 2\*\*63-1"),
    ("steps=true", "steps=True is not a valid int"),
    ("batch_size=2.5", "is not a valid int"),
    ("lr=.inf", "lr=inf must be a positive, finite number"),
    ("lr=.nan", "lr=nan must be a positive, finite number"),
    ("weight_decay=-1", "weight_decay=-1.0 must be 0"),
    ("grad_clip=.inf", "grad_clip=inf must be 0"),
    ("max_nonfinite_steps=0", "max_nonfinite_steps=0 must be 1 or more"),
    ("model=[1, 2]", "is not a valid str"),
    ("log=true", "log=True is not a valid str"),
    ("resume=-3", "resume=-3 is not allowed; use true"),
    ("stream_tiles=never", "stream_tiles='never' is not allowed; use auto, always$"),
    ("host_buffer_bytes=.inf", "host_buffer_bytes: not a byte size"),
    ("lr=[1", r"--set 'lr=\[1': the value cannot be parsed \(expected"),
    ("overwrite=true", "need a checkpoint directory"),
])
def test_bad_values_are_refused_by_type_and_range(override, message):
    with pytest.raises(ConfigError, match=message):
        Config.load(None, [override])


def test_overwrite_and_resume_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="set only one"):
        Config.load(None, [f"save_dir={tmp_path}", "resume=true", "overwrite=true"])
    assert Config.load(None, [f"save_dir={tmp_path}", "resume=4"]).resume_step == 4
    assert Config.load(None, [f"save_dir={tmp_path}", "resume=0"]).resuming  # a converted checkpoint is step 0
    assert not Config.load(None, [f"save_dir={tmp_path}", "resume=false"]).resuming


def test_a_config_built_in_python_is_checked_by_type():
    with pytest.raises(ConfigError, match="steps=True is not a valid int"):
        Config(steps=True)
    assert Config(lr=1).lr == 1.0 and isinstance(Config(lr=1).lr, float)


@pytest.mark.parametrize("name,text,message", [
    ("dup.yaml", "steps: 3\nlr: 0.1\nsteps: 4\n", r"key 'steps' is given twice \(lines 1 and 3\); keep one"),
    ("dup.json", '{"steps": 3, "steps": 4}', "key 'steps' is given twice in one object; keep one"),
    ("nested.yaml", "model: gpt2-tiny\nsteps: {a: 1, a: 2}\n", "key 'a' is given twice"),
])
def test_duplicate_keys_are_refused(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        Config.from_file(str(tmp_path / name))


@pytest.mark.parametrize("ds,message", [
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": "abc"}}},
     r"ds.json: DeepSpeed zero_optimization.offload_param.buffer_size='abc' must be a whole number"),
    ({"zero_optimization": 5}, "DeepSpeed zero_optimization must be a JSON object of keys and values, not 5"),
    ({"zero_optimization": {"offload_param": {"device": ["cpu"]}}}, r"offload_param.device=\['cpu'\]; use none"),
    ({"zero_optimization": {"offload_param": {"buffer_count": 0}}}, "buffer_count=0 must be a whole number"),
    ({"zero_optimization": {}, "bf16": True}, "DeepSpeed bf16 must be a JSON object"),
    ({"zero_optimization": {}, "optimizer": {"type": "adam", "params": {"betas": "x"}}},
     "optimizer.params.betas='x' must be a number or a list of numbers"),
    ({"zero_optimization": {"stage": 7}}, r"\(a DeepSpeed config, mapped as docs/config.md shows\): stage=7 is not"),
    ({"zero_optimization": {}, "gradient_clipping": "high"}, "grad_clip='high' is not a valid float"),
])
def test_deepspeed_values_are_checked_by_type(tmp_path, ds, message):
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match=message):
        Config.from_file(str(tmp_path / "ds.json"))


def ds_file(tmp_path, **ds):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}, **ds}))
    return str(path)


def test_deepspeed_batch_keys_mean_what_deepspeed_means(tmp_path):
    """The global batch is micro x accumulation x data-parallel size; train_batch_size must agree."""
    c = Config.from_file(ds_file(tmp_path, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2))
    assert c.with_batch_for(1).batch_size == 8 and c.with_batch_for(4).batch_size == 32
    c = Config.from_file(ds_file(tmp_path, train_batch_size=16, gradient_accumulation_steps=2))
    assert c.with_batch_for(4).batch_size == 16 and c.micro_batch_size is None
    c = Config.from_file(ds_file(tmp_path, train_batch_size=10, train_micro_batch_size_per_gpu=4,
                                 gradient_accumulation_steps=2))
    with pytest.raises(ConfigError, match=r"train_batch_size\) 10 disagrees with .* 4 x .* 2 x data-parallel "
                                          r"size 1 = 8; make them agree"):
        c.with_batch_for(1)


@pytest.mark.parametrize("scheduler,keys", [
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 5}},
     dict(lr=2e-3, warmup_start_lr=1e-5, warmup_steps=5, warmup_type="log", lr_decay="constant")),
    ({"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 2, "total_num_steps": 9,
                                          "warmup_type": "linear"}},
     dict(lr=1e-3, warmup_steps=2, warmup_type="linear", lr_decay="linear", final_lr=0.0, steps=9)),
    ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "total_num_steps": 12, "cos_min_ratio": 0.1}},
     dict(lr=4e-3, warmup_steps=3, lr_decay="cosine", final_lr=4e-4, steps=12)),
])
def test_deepspeed_schedulers_map_to_warmup_and_decay(tmp_path, scheduler, keys):
    c = Config.from_file(ds_file(tmp_path, scheduler=scheduler,
                                 optimizer={"type": "AdamW", "params": {"lr": 4e-3}}))
    assert {k: getattr(c, k) for k in keys} == pytest.approx(keys)


def test_an_unsupported_deepspeed_scheduler_lists_the_supported_ones(tmp_path):
    with pytest.raises(ConfigError, match="scheduler type OneCycle is not supported; use one of WarmupLR, "
                                          "WarmupDecayLR, WarmupCosineLR"):
        Config.from_file(ds_file(tmp_path, scheduler={"type": "OneCycle", "params": {}}))


def test_a_deepspeed_config_trains_as_its_zinfjax_equivalent(tmp_path):
    """The same losses from a DeepSpeed config and the zinfjax config it means (batch, accumulation, schedule)."""
    from zinfjax.training.loop import run

    ds = Config.from_file(ds_file(
        tmp_path, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
        optimizer={"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 2,
                                                       "total_num_steps": 4, "warmup_type": "linear"}}))
    ds = ds.replace(mesh="data:2", seq_len=16)
    same = Config(batch_size=8, grad_accum=2, lr=3e-3, weight_decay=0.01, warmup_steps=2, lr_decay="linear",
                  steps=4, mesh="data:2", seq_len=16)
    a, b = run(ds, progress=False), run(same, progress=False)
    assert a["config"]["batch_size"] == 8
    assert [s["loss"] for s in a["steps"]] == [s["loss"] for s in b["steps"]]
    assert [s["lr"] for s in a["steps"]] == [s["lr"] for s in b["steps"]] == pytest.approx([0, 1.5e-3, 3e-3, 1.5e-3])


def test_a_warmup_longer_than_the_run_is_accepted_with_a_warning(capsys):
    from zinfjax.training.loop import run

    log = run(Config(steps=2, warmup_steps=5, seq_len=16, mesh="data:1"), progress=False)
    assert len(log["steps"]) == 2
    assert "warmup_steps=5 is longer than the run (steps=2)" in capsys.readouterr().err
