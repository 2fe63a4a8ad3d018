"""`Config`: one frozen dataclass for a run, loaded from JSON/YAML, ``--set`` overrides or a DeepSpeed config.

The key names are a public contract; see docs/config.md.

Example:
    >>> cfg = Config.load("run.yaml", ["stage=3", "params=nvme", "nvme_path=/mnt/nvme/run1"])
    >>> cfg.stage
    3
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, fields
from typing import Any

import yaml

from zinfjax.errors import ConfigError
from zinfjax.units import parse_bytes

TIERS = ("device", "host", "nvme")
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adagrad", "rmsprop", "lamb", "adafactor")
DECAYS = ("constant", "linear", "cosine")
WARMUPS = ("linear", "log")
TIER_KEYS = ("params", "optimizer", "gradients", "activations")


@dataclass(frozen=True)
class Config:
    """Everything a zinfjax run is built from.

    Example:
        >>> Config(stage=3, params="nvme", optimizer="nvme", nvme_path="/mnt/nvme/run1")
    """

    # ZeRO
    stage: int = 0
    params: str = "device"
    optimizer: str = "device"
    gradients: str = "device"
    activations: str = "device"
    kv_cache: str = "device"
    nvme_path: str | None = None
    prefetch_depth: int | None = None  # None: from memory_limit (engine/budget.py)
    host_buffer_bytes: int | None = None  # None: from memory_limit
    memory_limit: int | None = None  # None: the cgroup's limit or the available memory, less a margin
    # numerics
    precision: str = "fp32"
    grad_clip: float = 0.0
    grad_accum: int = 1
    # layout
    mesh: str = "data:-1"
    # run
    model: str = "gpt2-tiny"
    data: str = "demo"
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-4
    optimizer_name: str = "adamw"
    weight_decay: float = 0.0
    warmup_steps: int = 0
    warmup_start_lr: float = 0.0
    warmup_type: str = "linear"
    lr_decay: str = "constant"
    final_lr: float = 0.0
    seed: int = 0
    log: str | None = None
    # checkpoints
    save_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False

    def __post_init__(self):
        for key in ("host_buffer_bytes", "memory_limit"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, parse_bytes(getattr(self, key)))
        _validate(self)

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> Config:
        """Builds a Config from a mapping, refusing unknown keys with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(unknown)}; known keys are {', '.join(sorted(known))}"
            )
        return cls(**{k: _coerce(k, v) for k, v in values.items()})

    @classmethod
    def from_file(cls, path: str) -> Config:
        """Reads a JSON or YAML file; a DeepSpeed config (with ``zero_optimization``) is mapped."""
        values = read_mapping(path)
        if is_deepspeed(values):
            from zinfjax.deepspeed_config import from_deepspeed

            return cls.from_dict(from_deepspeed(values, source=path), source=path)
        return cls.from_dict(values, source=path)

    @classmethod
    def load(cls, path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
        """A config file (optional) plus ``key=value`` overrides, applied in order.

        Example:
            >>> Config.load(None, ["model=llama-tiny", "steps=10"]).steps
            10
        """
        base = cls.from_file(path) if path else cls()
        return base.override(overrides)

    def override(self, overrides: list[str] | tuple[str, ...]) -> Config:
        """Returns a copy with ``key=value`` strings applied; values parse as YAML scalars."""
        changes = {}
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"override {item!r} is not of the form key=value")
            changes[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        return Config.from_dict({**self.to_dict(), **changes}, source="--set")

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- derived -------------------------------------------------------------------------------

    def mesh_axes(self) -> dict[str, int]:
        """The mesh as ``{"data": 4, "model": 2}``; ``-1`` means every remaining device."""
        return parse_mesh(self.mesh)

    @property
    def uses_nvme(self) -> bool:
        return any(getattr(self, k) == "nvme" for k in (*TIER_KEYS, "kv_cache"))


def parse_mesh(text: str) -> dict[str, int]:
    """Parses ``"data:4,model:2"``.

    Example:
        >>> parse_mesh("data:4,model:2")
        {'data': 4, 'model': 2}
    """
    axes: dict[str, int] = {}
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(data|model)\s*:\s*(-1|[1-9][0-9]*)\s*", part)
        if not m or m.group(1) in axes:
            raise ConfigError(
                f"mesh {text!r} is not valid; write axes as name:size with names data and model, "
                f"e.g. 'data:4,model:2' (-1 means all remaining devices)"
            )
        axes[m.group(1)] = int(m.group(2))
    if list(axes.values()).count(-1) > 1:
        raise ConfigError(f"mesh {text!r}: only one axis may be -1")
    return axes


def read_mapping(path: str, what: str = "config file", error: type[Exception] = ConfigError) -> dict[str, Any]:
    """Reads a JSON or YAML file into a dict; errors (of type ``error``) name the file as ``what``.

    Example:
        >>> read_mapping("examples/demo.yaml")["model"]
        'gpt2-mini'
    """
    if not os.path.isfile(path):
        raise error(f"{what} {path!r} does not exist")
    try:
        with open(path) as f:
            text = f.read()
        values = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise error(f"{what} {path!r} cannot be parsed: {str(err).splitlines()[0]}") from err
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise error(f"{what} {path!r} must hold a mapping of keys to values")
    return values


def is_deepspeed(values: dict[str, Any]) -> bool:
    return "zero_optimization" in values


_TYPES = {f.name: f.type for f in fields(Config)}


def _coerce(key: str, value: Any) -> Any:
    kind = _TYPES[key]
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{key} needs a value")
    if key in ("host_buffer_bytes", "memory_limit"):
        return parse_bytes(value)
    try:
        if kind == "int" and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "float" and not isinstance(value, bool):
            return float(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            raise ValueError
        if kind.startswith("str"):
            return str(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{key}={value!r} is not a valid {kind.split(' ')[0]}") from err
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate(c: Config) -> None:
    _check(c.stage in (0, 1, 2, 3), f"stage={c.stage!r} is not allowed; use 0, 1, 2 or 3")
    for key in (*TIER_KEYS, "kv_cache"):
        value = getattr(c, key)
        _check(value in TIERS, f"{key}={value!r} is not allowed; use one of {', '.join(TIERS)}")
    _check(
        not c.uses_nvme or bool(c.nvme_path),
        "a tier is 'nvme' but nvme_path is not set; set nvme_path=/path/on/fast/disk",
    )
    _check(c.prefetch_depth is None or c.prefetch_depth >= 0, f"prefetch_depth={c.prefetch_depth} must be 0 or more")
    for key in ("host_buffer_bytes", "memory_limit"):
        _check(getattr(c, key) is None or getattr(c, key) > 0, f"{key}={getattr(c, key)} must be positive")
    _check(c.precision in PRECISIONS, f"precision={c.precision!r} is not allowed; use {', '.join(PRECISIONS)}")
    _check(c.grad_clip >= 0, f"grad_clip={c.grad_clip} must be 0 (off) or positive")
    _check(c.grad_accum >= 1, f"grad_accum={c.grad_accum} must be 1 or more")
    _check(
        c.optimizer_name in OPTIMIZERS,
        f"optimizer_name={c.optimizer_name!r} is not allowed; use one of {', '.join(OPTIMIZERS)}",
    )
    for key in ("steps", "batch_size", "seq_len"):
        _check(getattr(c, key) >= 1, f"{key}={getattr(c, key)} must be 1 or more")
    _check(c.lr > 0, f"lr={c.lr} must be positive")
    _check(c.warmup_steps >= 0, f"warmup_steps={c.warmup_steps} must be 0 (none) or more")
    _check(c.lr_decay in DECAYS, f"lr_decay={c.lr_decay!r} is not allowed; use one of {', '.join(DECAYS)}")
    _check(c.warmup_type in WARMUPS, f"warmup_type={c.warmup_type!r} is not allowed; use one of {', '.join(WARMUPS)}")
    _check(0 <= c.final_lr <= c.lr, f"final_lr={c.final_lr} must be between 0 and lr={c.lr}")
    _check(0 <= c.warmup_start_lr <= c.lr, f"warmup_start_lr={c.warmup_start_lr} must be between 0 and lr={c.lr}")
    _check(c.save_every >= 0, f"save_every={c.save_every} must be 0 (only at the end) or positive")
    _check(c.keep_checkpoints >= 1, f"keep_checkpoints={c.keep_checkpoints} must be 1 or more")
    _check(bool(c.save_dir) or not (c.save_every or c.resume),
           "save_every and resume need a checkpoint directory; set save_dir=/path/to/checkpoints")
    parse_mesh(c.mesh)
    from zinfjax.models.configs import ModelConfig

    ModelConfig.resolve(c.model)


KEY_DOCS = {
    "stage": "ZeRO stage 0-3: what is sharded over the data axis (0 nothing, 1 optimizer state, 2 + gradients, "
             "3 + parameters)",
    "params": "tier of the parameters: device, host or nvme",
    "optimizer": "tier of the fp32 master weights and optimizer state: device, host or nvme",
    "gradients": "tier of spooled gradients (used with grad_clip): device, host or nvme",
    "activations": "tier of the layer-boundary activation checkpoints: device, host or nvme",
    "nvme_path": "directory on a fast local disk for the nvme tier",
    "prefetch_depth": "layers read ahead of compute (0 reads on demand); default: what memory_limit allows (1-4)",
    "host_buffer_bytes": "bound on host staging buffers for NVMe I/O, e.g. 512MiB; default: from memory_limit",
    "memory_limit": "host memory the process may use, e.g. 2GiB; the engine derives its buffers and read-ahead "
                    "from it; default: the memory cgroup's limit or the available memory, less a margin",
    "precision": "fp32, bf16 or fp16 compute (master weights stay fp32)",
    "grad_clip": "global-norm gradient clipping threshold; 0 is off",
    "grad_accum": "micro-batches per optimizer step",
    "mesh": "device mesh, e.g. data:4,model:2; -1 takes the remaining devices",
    "model": f"named model size ({', '.join(['gpt2-tiny', 'gpt2-small', '...', 'llama-7b'])}), a ModelConfig "
             "JSON/YAML file, or a zinfjax checkpoint directory whose model to train (zinfjax convert writes one)",
    "data": "demo (embedded corpus), a .bin uint16 token file, a .txt file, a directory or a glob",
    "steps": "optimizer steps to run",
    "batch_size": "sequences per optimizer step (split over micro-batches and the data axis)",
    "seq_len": "tokens per sequence",
    "lr": "learning rate",
    "optimizer_name": f"optax optimizer: {', '.join(OPTIMIZERS)}",
    "weight_decay": "decoupled weight decay for adamw, lion, lamb and adafactor",
    "warmup_steps": "steps of learning-rate warmup from warmup_start_lr to lr (0: none)",
    "warmup_start_lr": "the learning rate the warmup starts from",
    "warmup_type": "linear, or log (DeepSpeed WarmupLR's default)",
    "lr_decay": "after the warmup: constant, linear or cosine decay to final_lr at the last step",
    "final_lr": "the learning rate at the last step of a linear or cosine decay",
    "seed": "seed of the initial parameters and of the data order",
    "log": "path of the JSON log; a PNG loss curve is written beside it",
    "kv_cache": "tier of the KV cache of `zinfjax generate`: device, host or nvme",
    "save_dir": "checkpoint directory: <save_dir>/<step>/ (orbax layout; see docs/checkpoint.md)",
    "save_every": "save a checkpoint every N steps (0: only after the last step); needs save_dir",
    "keep_checkpoints": "how many of the newest checkpoints to keep",
    "resume": "continue from the newest complete checkpoint in save_dir, under this run's mesh, stage and tiers",
}
