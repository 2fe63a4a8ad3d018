"""Maps a DeepSpeed config JSON onto zinfjax `Config` keys (docs/config.md, "DeepSpeed configs").

Keys that only tune how DeepSpeed's own communication or allocator works have no
meaning under XLA and are accepted without effect (`NO_EFFECT`). Any other key that
zinfjax does not implement is refused, and the error lists every such key at once.

Example:
    >>> from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    {'stage': 3, 'params': 'host'}
"""

from __future__ import annotations

from typing import Any

from zinfjax.errors import ConfigError, printable

DEVICES = {"none": "device", "cpu": "host", "nvme": "nvme"}

# Knobs of DeepSpeed's own collectives and allocator: XLA schedules these itself.
NO_EFFECT = {
    "zero_optimization": {
        "contiguous_gradients", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
        "allgather_partitions", "allgather_bucket_size", "round_robin_gradients",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
        "stage3_gather_16bit_weights_on_model_save", "memory_efficient_linear",
        "stage3_param_persistence_threshold", "elastic_checkpoint", "load_from_fp32_weights",
    },
    "offload_param": {"pin_memory", "max_in_cpu"},
    "offload_optimizer": {"pin_memory", "fast_init", "buffer_count", "pipeline_read", "pipeline_write", "ratio"},
    "top": {"aio", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
            "gradient_accumulation_dtype", "communication_data_type"},
}
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def from_deepspeed(ds: dict[str, Any], source: str = "DeepSpeed config") -> dict[str, Any]:
    """Returns the zinfjax config keys a DeepSpeed config asks for.

    Raises:
        ConfigError: listing every key that zinfjax does not support.
    """
    out: dict[str, Any] = {}
    unsupported: list[str] = []
    for key, value in ds.items():
        handler = _TOP.get(key)
        if handler:
            handler(value, out, unsupported)
        elif key not in NO_EFFECT["top"]:
            unsupported.append(key)
    if unsupported:
        raise ConfigError(
            f"{source}: these DeepSpeed keys are not supported by zinfjax: {', '.join(map(printable, unsupported))}; "
            f"remove them (docs/config.md lists the mapping)"
        )
    _ratios(out)
    if "micro_batch_size" in out and "batch_size" not in out:
        out["batch_size"] = 0  # the global batch follows from the micro-batch once the mesh is known
    return out


def _zero(zero: Any, out: dict, unsupported: list[str]) -> None:
    for key, value in _mapping(zero, "zero_optimization").items():
        if key == "stage":
            out["stage"] = value
        elif key in ("offload_param", "offload_optimizer"):
            _offload(key, value, out, unsupported)
        elif key == "sub_group_size":
            out["sub_group_size"] = _count(value, "zero_optimization.sub_group_size")
        elif key not in NO_EFFECT["zero_optimization"]:
            unsupported.append(f"zero_optimization.{key}")


def _offload(section: str, spec: Any, out: dict, unsupported: list[str]) -> None:
    target = "params" if section == "offload_param" else "optimizer"
    where = f"zero_optimization.{section}"
    for key, value in _mapping(spec, where).items():
        if key == "device":
            if not isinstance(value, str) or value not in DEVICES:
                raise ConfigError(f"{where}.device={value!r}; use none, cpu or nvme")
            out[target] = DEVICES[value]
        elif key == "nvme_path":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{where}.nvme_path={value!r} must be a directory path")
            out["nvme_path"] = value
        elif section == "offload_param" and key == "buffer_count":
            out["prefetch_depth"] = _count(value, f"{where}.buffer_count") - 1
        elif section == "offload_param" and key == "buffer_size":
            out["_buffer_size"] = _count(value, f"{where}.buffer_size")
        elif key not in NO_EFFECT[section]:
            unsupported.append(f"{where}.{key}")
    elements = out.pop("_buffer_size", None)
    if elements is not None:
        # DeepSpeed sizes buffers in elements of the 16-bit compute dtype, one per buffer.
        out["host_buffer_bytes"] = 2 * elements * (out.get("prefetch_depth", 4) + 1)


def _mapping(value: Any, where: str) -> dict:
    """A section of the DeepSpeed config, which must be a JSON object."""
    if not isinstance(value, dict):
        raise ConfigError(f"DeepSpeed {where} must be a JSON object of keys and values, not {value!r}")
    return value


def _count(value: Any, where: str) -> int:
    """A positive whole number (DeepSpeed writes 1e8 for a buffer size, so an integral float is one)."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 1:
        raise ConfigError(f"DeepSpeed {where}={value!r} must be a whole number, 1 or more")
    return int(value)


def _precision(name: str):
    def handle(value: Any, out: dict, unsupported: list[str]) -> None:
        value = _mapping(value, name)
        if value.get("enabled", False) in (True, "auto"):
            out["precision"] = name
        extra = set(value) - {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                              "hysteresis", "min_loss_scale", "auto_cast"}
        unsupported.extend(f"{name}.{k}" for k in sorted(extra))

    return handle


def _optimizer(value: Any, out: dict, unsupported: list[str]) -> None:
    value = _mapping(value, "optimizer")
    name = str(value.get("type", "")).lower()
    names = {"adam": "adam", "adamw": "adamw", "sgd": "sgd", "lion": "lion", "adagrad": "adagrad"}
    if name not in names:
        unsupported.append(f"optimizer.type={value.get('type')!r}")
        return
    out["optimizer_name"] = names[name]
    params = _mapping(value.get("params", {}), "optimizer.params")
    if "lr" in params:
        out["lr"] = params["lr"]
    if "weight_decay" in params:
        out["weight_decay"] = params["weight_decay"]
    defaults = {"betas": [0.9, 0.999], "eps": 1e-8}
    extra = set(params) - {"lr", "weight_decay", "torch_adam", "adam_w_mode"} - set(defaults)
    extra |= {k for k, v in defaults.items() if k in params and _plain(params[k], f"optimizer.params.{k}") != v}
    unsupported.extend(f"optimizer.params.{k}" for k in sorted(extra))


def _plain(value: Any, where: str) -> Any:
    try:
        if isinstance(value, list | tuple):
            return [float(x) for x in value]
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"DeepSpeed {where}={value!r} must be a number or a list of numbers") from err


def _scheduler(value: Any, out: dict, unsupported: list[str]) -> None:
    """DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR as zinfjax's warmup and decay keys."""
    value = _mapping(value, "scheduler")
    kind = value.get("type")
    if kind not in SCHEDULERS:
        raise ConfigError(f"DeepSpeed scheduler type {printable(kind)} is not supported; use one of "
                          f"{', '.join(SCHEDULERS)}, or remove the scheduler section")
    params = _mapping(value.get("params", {}), "scheduler.params")
    known = {"warmup_num_steps", "warmup_type", "total_num_steps", "last_batch_iteration"}
    known |= {"warmup_min_ratio", "cos_min_ratio"} if kind == "WarmupCosineLR" else {"warmup_min_lr", "warmup_max_lr"}
    unsupported.extend(f"scheduler.params.{k}" for k in sorted(set(params) - known))
    out["warmup_steps"] = _count(params.get("warmup_num_steps", 1000), "scheduler.params.warmup_num_steps")
    out["warmup_type"] = params.get("warmup_type", "log")
    if "total_num_steps" in params:
        out["steps"] = _count(params["total_num_steps"], "scheduler.params.total_num_steps")
    if kind == "WarmupCosineLR":  # peak: the optimizer's lr; start and end as ratios of it
        out["_warmup_ratio"] = _plain(params.get("warmup_min_ratio", 0.0), "scheduler.params.warmup_min_ratio")
        out["_final_ratio"] = _plain(params.get("cos_min_ratio", 0.0001), "scheduler.params.cos_min_ratio")
        out["lr_decay"] = "cosine"
        return
    out["warmup_start_lr"] = _plain(params.get("warmup_min_lr", 0.0), "scheduler.params.warmup_min_lr")
    out["_peak_lr"] = _plain(params.get("warmup_max_lr", 0.001), "scheduler.params.warmup_max_lr")
    out["lr_decay"] = "linear" if kind == "WarmupDecayLR" else "constant"
    out["final_lr"] = 0.0


def _ratios(out: dict) -> None:
    """The scheduler's learning rates, once the optimizer's lr is known (DeepSpeed's warmup_max_lr overrides it)."""
    if "_peak_lr" in out:
        out["lr"] = out.pop("_peak_lr")
    if "_warmup_ratio" in out:
        lr = float(out.get("lr", 0.001))
        out["warmup_start_lr"] = out.pop("_warmup_ratio") * lr
        out["final_lr"] = out.pop("_final_ratio") * lr


def _setter(key: str):
    def handle(value: Any, out: dict, unsupported: list[str]) -> None:
        out[key] = value

    return handle


_TOP = {
    "zero_optimization": _zero,
    "bf16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "optimizer": _optimizer,
    "gradient_clipping": _setter("grad_clip"),
    "gradient_accumulation_steps": _setter("grad_accum"),
    # DeepSpeed's batch: micro-batch per data-parallel rank x accumulation steps x data-parallel size = global
    "train_micro_batch_size_per_gpu": _setter("micro_batch_size"),
    "train_batch_size": _setter("batch_size"),
    "scheduler": _scheduler,
}
