"""`Config`: one frozen dataclass for a run, loaded from JSON/YAML, ``--set`` overrides or a DeepSpeed config.

The key names are a public contract; see docs/config.md. The config is the user's record of the run, flat and
kept as given; the layers below it take its keys by concern as frozen sections (`zinfjax.sections`:
`Config.section`, `Config.engine_settings`), never the config itself.

Example:
    >>> cfg = Config.load("examples/demo.yaml", ["stage=3", "params=nvme", "nvme_path=/mnt/nvme/run1"])
    >>> cfg.stage, cfg.params, cfg.model
    (3, 'nvme', 'gpt2-mini')
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import yaml

from zinfjax._util.byte_sizes import parse_bytes
from zinfjax._util.choices import PRECISIONS, TIER_KEYS, TIERS
from zinfjax._util.mapping_files import DuplicateKeyError, UniqueKeyLoader, parse_problem, read_mapping
from zinfjax._util.tier_split import SplitError, TierSplit
from zinfjax.errors import ConfigError, printable
from zinfjax.sections import EngineSettings, Memory, Numerics, Section, Tiering

OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adagrad", "rmsprop", "lamb", "adafactor")
DECAYS = ("constant", "linear", "cosine")
WARMUPS = ("linear", "log")
TIER_MODES = ("default", "manual", "auto")
UPDATE_ON = ("auto", "device", "host")
RECOMPUTE = ("auto", "always", "never")
STREAM_TILES = ("auto", "always")
S = TypeVar("S", bound=Section)


@dataclass(frozen=True)
class Config:
    """Everything a zinfjax run is built from, as the user gave it; its keys by concern are `zinfjax.sections`.

    Example:
        >>> config = Config(stage=3, params="nvme", optimizer="nvme", nvme_path="/mnt/nvme/run1")
        >>> config.uses_nvme, config.replace(params="host").params
        (True, 'host')
        >>> Config(stage=4)
        Traceback (most recent call last):
        zinfjax.errors.ConfigError: stage=4 is not allowed; use 0, 1, 2 or 3
    """

    # ZeRO
    stage: int = 0
    params: str = "device"
    optimizer: str = "device"
    gradients: str = "device"
    activations: str = "device"
    tiers: str = "default"  # "auto": the tier keys from `zinfjax plan`; default: auto with nvme_path and no tier key
    kv_cache: str = "device"
    nvme_path: str | None = None
    verify_chunks: bool = True  # check each NVMe chunk's crc32c as it is read back (docs/store.md, "Integrity")
    prefetch_depth: int | None = None  # None: from memory_limit (engine/budget.py)
    host_buffer_bytes: int | None = None  # None: from memory_limit
    memory_limit: int | None = None  # None: the cgroup's limit or the available memory, less a margin
    sub_group_size: int | None = None  # parameters per update part; None: parts only when memory needs them
    tiles: str = "auto"  # a block's MLP and attention in this many tiles (models/tiling.py); auto: the fewest that fit
    stream_tiles: str = "auto"  # stream a tiled layer tile by tile: always, or auto (only when the layer does not fit)
    lora_rank: int = 0  # LoRA adapters of this rank on lora_targets, the base frozen (models/lora.py); 0: none
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank
    lora_targets: str = "q,v"  # comma-separated: any of q, k, v, o, up, gate, down
    lora_dropout: float = 0.0  # dropout on the adapters' input while training
    update_on: str = "auto"  # where the optimizer update runs: device, host, or auto (engine.update_location)
    recompute: str = "auto"  # rerun each layer's forward in its backward: always, never or auto (docs/engine.md)
    max_reuse_distance: int | None = None  # keep parameters for the backward; unset: what fits (engine/reuse.py)
    # numerics
    precision: str = "fp32"
    grad_clip: float = 0.0
    grad_accum: int = 1
    # layout
    mesh: str = "data:-1"
    # run
    model: str = "gpt2-tiny"
    data: str = "demo"
    data_field: str = "text"  # the text's field in JSON Lines, Parquet or a datasets directory
    tokenizer: str | None = None  # None: the model's own (zinfjax/checkpoint/tokenizer.py), else bytes or a directory
    steps: int = 100
    batch_size: int = 8  # the global batch; 0 with micro_batch_size: micro x grad_accum x data-parallel size
    micro_batch_size: int | None = None  # DeepSpeed's train_micro_batch_size_per_gpu
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
    tensorboard_dir: str | None = None
    max_nonfinite_steps: int = 3
    # checkpoints
    save_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool | int = False
    overwrite: bool = False
    allow_config_change: bool = False

    def __post_init__(self):
        for f in fields(self):  # a Config built in Python is checked by type as one loaded from a file
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name)))
        _validate(self)

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> Config:
        """Builds a Config from a mapping, refusing unknown keys with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(printable(k) for k in set(values) - known)  # a YAML key may be a number, or hold a newline
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
            from zinfjax._util.deepspeed_config import from_deepspeed

            with _naming(path, ""):
                mapped = from_deepspeed(values, source=path)
            # a value DeepSpeed passes through is checked as the zinfjax key it maps to
            with _naming(path, " (a DeepSpeed config, mapped as docs/config.md shows)"):
                return cls.from_dict(mapped, source=path)
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
            changes[key.strip()] = _parse_value(item, raw) if raw.strip() else None
        return Config.from_dict({**self.to_dict(), **changes}, source="--set")

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- sections ------------------------------------------------------------------------------

    def section(self, kind: type[S]) -> S:
        """This config's keys of one concern, as the frozen section ``kind`` (`zinfjax.sections.SECTIONS`).

        Example:
            >>> Config(memory_limit="2GiB").section(Memory).memory_limit
            2147483648
        """
        return kind(**{f.name: getattr(self, f.name) for f in fields(kind)})

    def engine_settings(self) -> EngineSettings:
        """The sections an engine is built from (`zinfjax.engine.Engine`), and the seed of its steps' keys."""
        return EngineSettings(self.section(Tiering), self.section(Memory), self.section(Numerics), self.seed)

    # ---- derived -------------------------------------------------------------------------------

    def with_batch_for(self, data: int) -> Config:
        """This config with its global batch settled for a data axis of ``data`` devices.

        With ``micro_batch_size`` (DeepSpeed's ``train_micro_batch_size_per_gpu``) the global batch is
        ``micro_batch_size * grad_accum * data``, as in DeepSpeed; a ``batch_size`` (DeepSpeed's
        ``train_batch_size``) that disagrees is refused with the arithmetic.

        Example:
            >>> Config(micro_batch_size=4, grad_accum=2, batch_size=0).with_batch_for(2).batch_size
            16
        """
        if self.micro_batch_size is None:
            return self
        want = self.micro_batch_size * self.grad_accum * data
        if self.batch_size not in (0, want):
            raise ConfigError(
                f"batch_size (train_batch_size) {self.batch_size} disagrees with micro_batch_size "
                f"(train_micro_batch_size_per_gpu) {self.micro_batch_size} x grad_accum (gradient_accumulation_steps) "
                f"{self.grad_accum} x data-parallel size {data} = {want}; make them agree")
        return self.replace(batch_size=want)

    def mesh_axes(self) -> dict[str, int]:
        """The mesh as ``{"data": 4, "model": 2}``; ``-1`` means every remaining device."""
        return parse_mesh(self.mesh)

    @property
    def uses_nvme(self) -> bool:
        return self.section(Tiering).uses_nvme

    @property
    def may_use_nvme(self) -> bool:
        """Whether the run may stream from NVMe: a tier key names it, or tiers=auto has an ``nvme_path`` to choose."""
        return self.uses_nvme or (self.tiers_auto and bool(self.nvme_path))

    @property
    def tiers_auto(self) -> bool:
        """Whether the run takes its tier keys from the plan: ``tiers=auto``, or ``tiers`` left at its default with
        ``nvme_path`` set and every tier key at its default (device)."""
        untouched = all(getattr(self, k) == "device" for k in TIER_KEYS)
        return self.tiers == "auto" or (self.tiers == "default" and bool(self.nvme_path) and untouched)

    @property
    def resuming(self) -> bool:
        """Whether the run continues from a checkpoint: ``resume=true`` or ``resume=STEP``."""
        return self.resume is True or self.resume_step is not None

    @property
    def resume_step(self) -> int | None:
        """The step ``resume=STEP`` names; None for ``resume=true`` (the newest verified) and ``false``."""
        return self.resume if type(self.resume) is int else None


@contextlib.contextmanager
def _naming(path: str, what: str):
    """Prefixes a `ConfigError` raised in the block with the file it came from, unless it names it already."""
    try:
        yield
    except ConfigError as err:
        if str(err).startswith(path):
            raise
        raise ConfigError(f"{path}{what}: {err}") from err


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


def _parse_value(item: str, raw: str) -> Any:
    """The value of a ``--set key=value`` override, parsed as a YAML scalar."""
    try:
        return yaml.load(raw, Loader=UniqueKeyLoader)
    except (yaml.YAMLError, DuplicateKeyError) as err:
        raise ConfigError(f"--set {item!r}: the value cannot be parsed ({parse_problem(err)}); "
                          "quote it, e.g. key='value'") from err


def is_deepspeed(values: dict[str, Any]) -> bool:
    return "zero_optimization" in values


_TYPES = {f.name: f.type for f in fields(Config)}


def _coerce(key: str, value: Any) -> Any:
    """``value`` as the type of ``key``; a value of another kind (a bool for a number, a list) is refused."""
    kind = _TYPES[key]
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{key} needs a value")
    if key in ("host_buffer_bytes", "memory_limit"):
        try:
            return parse_bytes(value)
        except ConfigError as err:
            raise ConfigError(f"{key}: {err}") from err
    if key == "resume":
        return _resume(value)
    name = kind.split(" ")[0]
    if isinstance(value, bool) != (name == "bool") or isinstance(value, dict | list | tuple | set):
        raise ConfigError(f"{key}={value!r} is not a valid {name}")
    try:
        if name == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if name == "float":
            return float(value)
        if name == "str":
            return str(value)
    except (TypeError, ValueError, OverflowError) as err:
        raise ConfigError(f"{key}={value!r} is not a valid {name}") from err
    return value


def _resume(value: Any) -> bool | int:
    """``resume``: true, false, or the step of the checkpoint to continue from."""
    if isinstance(value, bool) or (isinstance(value, int) and value >= 0):
        return value
    raise ConfigError(f"resume={value!r} is not allowed; use true (the newest complete checkpoint), false, "
                      "or a step number (zinfjax ckpt info SAVE_DIR lists them)")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


MAX_SEED = 2**63 - 1  # jax.random.key and numpy's generators take a signed 64-bit seed


def _validate_tiers(c: Config) -> None:
    """The tier keys (a tier, or a split of layers: `zinfjax._util.tier_split`), ``tiers`` and ``nvme_path``."""
    _check(c.kv_cache in TIERS, f"kv_cache={c.kv_cache!r} is not allowed; use one of {', '.join(TIERS)}")
    for key in TIER_KEYS:
        try:
            object.__setattr__(c, key, str(TierSplit.parse(getattr(c, key))))  # one spelling: "host:12,nvme"
        except SplitError as err:
            raise ConfigError(f"{key}: {err}") from err
    _check(c.tiers in TIER_MODES, f"tiers={c.tiers!r} is not allowed; use manual (the tier keys as set), auto "
           "(the placement `zinfjax plan` recommends) or default (auto when nvme_path is set and no tier key is)")
    _check(not c.uses_nvme or bool(c.nvme_path),
           "a tier is 'nvme' but nvme_path is not set; set nvme_path=/path/on/fast/disk")


def _validate(c: Config) -> None:
    _check(c.stage in (0, 1, 2, 3), f"stage={c.stage!r} is not allowed; use 0, 1, 2 or 3")
    _validate_tiers(c)
    _check(c.prefetch_depth is None or c.prefetch_depth >= 0, f"prefetch_depth={c.prefetch_depth} must be 0 or more")
    _check(c.max_reuse_distance is None or c.max_reuse_distance >= 0,
           f"max_reuse_distance={c.max_reuse_distance} must be 0 or more (parameters), or unset")
    _check(c.recompute in RECOMPUTE, f"recompute={c.recompute!r} is not allowed; use {', '.join(RECOMPUTE)}")
    _check(c.update_on in UPDATE_ON, f"update_on={c.update_on!r} is not allowed; use {', '.join(UPDATE_ON)}")
    _check(c.update_on != "host" or c.optimizer != "device",
           "update_on=host runs the update where the optimizer state is, so it needs optimizer=host or nvme "
           "(optimizer=device)")
    _check(c.tiles == "auto" or (c.tiles.isdigit() and int(c.tiles) >= 1),
           f"tiles={c.tiles!r} is not allowed; use auto (the fewest tiles whose largest operation fits memory) or a "
           "positive count that divides the model's d_ff and heads")
    _check(c.lora_rank >= 0, f"lora_rank={c.lora_rank} must be 0 (no adapters) or a positive rank")
    _check(math.isfinite(c.lora_alpha) and c.lora_alpha > 0, f"lora_alpha={c.lora_alpha} must be a positive number")
    _check(0 <= c.lora_dropout < 1, f"lora_dropout={c.lora_dropout} must be at least 0 and below 1")
    _check(c.stream_tiles in STREAM_TILES,
           f"stream_tiles={c.stream_tiles!r} is not allowed; use {', '.join(STREAM_TILES)}")
    for key in ("host_buffer_bytes", "memory_limit", "sub_group_size"):
        _check(getattr(c, key) is None or getattr(c, key) > 0, f"{key}={getattr(c, key)} must be positive")
    _check(c.precision in PRECISIONS, f"precision={c.precision!r} is not allowed; use {', '.join(PRECISIONS)}")
    _check(math.isfinite(c.grad_clip) and c.grad_clip >= 0, f"grad_clip={c.grad_clip} must be 0 (off) or positive")
    _check(c.grad_accum >= 1, f"grad_accum={c.grad_accum} must be 1 or more")
    _check(
        c.optimizer_name in OPTIMIZERS,
        f"optimizer_name={c.optimizer_name!r} is not allowed; use one of {', '.join(OPTIMIZERS)}",
    )
    for key in ("steps", "seq_len", "max_nonfinite_steps"):
        _check(getattr(c, key) >= 1, f"{key}={getattr(c, key)} must be 1 or more")
    _check(c.micro_batch_size is None or c.micro_batch_size >= 1,
           f"micro_batch_size={c.micro_batch_size} must be 1 or more")
    _check(c.batch_size >= 1 or (c.batch_size == 0 and c.micro_batch_size),
           f"batch_size={c.batch_size} must be 1 or more (0 only with micro_batch_size: the batch follows from it)")
    _check(math.isfinite(c.lr) and c.lr > 0, f"lr={c.lr} must be a positive, finite number, e.g. 3e-4")
    _check(math.isfinite(c.weight_decay) and c.weight_decay >= 0,
           f"weight_decay={c.weight_decay} must be 0 (off) or a positive, finite number")
    _check(0 <= c.seed <= MAX_SEED, f"seed={c.seed} must be between 0 and 2**63-1")
    _check(c.warmup_steps >= 0, f"warmup_steps={c.warmup_steps} must be 0 (none) or more")
    _check(c.lr_decay in DECAYS, f"lr_decay={c.lr_decay!r} is not allowed; use one of {', '.join(DECAYS)}")
    _check(c.warmup_type in WARMUPS, f"warmup_type={c.warmup_type!r} is not allowed; use one of {', '.join(WARMUPS)}")
    _check(0 <= c.final_lr <= c.lr, f"final_lr={c.final_lr} must be between 0 and lr={c.lr}")
    _check(0 <= c.warmup_start_lr <= c.lr, f"warmup_start_lr={c.warmup_start_lr} must be between 0 and lr={c.lr}")
    _check(c.save_every >= 0, f"save_every={c.save_every} must be 0 (only at the end) or positive")
    _check(c.keep_checkpoints >= 1, f"keep_checkpoints={c.keep_checkpoints} must be 1 or more")
    _check(bool(c.save_dir) or not (c.save_every or c.resuming or c.overwrite),
           "save_every, resume and overwrite need a checkpoint directory; set save_dir=/path/to/checkpoints")
    _check(not (c.overwrite and c.resuming),
           "overwrite=true starts a new run in save_dir and resume continues the one there; set only one")
    parse_mesh(c.mesh)
    _check(bool(c.model), "model is empty; give a named size (e.g. gpt2-tiny), a model file or a checkpoint directory")


KEY_DOCS = {
    "stage": "ZeRO stage 0-3: what is sharded over the data axis (0 nothing, 1 optimizer state, 2 + gradients, "
             "3 + parameters)",
    "params": "tier of the parameters: device, host or nvme, or split by layer: host:12,nvme (the first 12 layers "
              "in host memory, the rest on NVMe)",
    "optimizer": "tier of the fp32 master weights and optimizer state: device, host or nvme, or split by layer "
                 "(host:12,nvme)",
    "gradients": "tier of spooled gradients (used with grad_clip): device, host or nvme, or split by layer",
    "activations": "tier of the layer-boundary activation checkpoints: device, host or nvme, or split by layer",
    "tiers": "manual: the tier keys as set; auto: params, optimizer, gradients and activations take the fastest "
             "placement that fits, as `zinfjax plan` predicts it: host memory first, split by layer with NVMe where "
             "a part does not fit (nvme considered only with nvme_path); default: auto when nvme_path is set and no "
             "tier key is, else manual",
    "nvme_path": "directory on a fast local disk for the nvme tier",
    "verify_chunks": "check the crc32c of every NVMe chunk the run reads back, so that a bit flipped on the disk or "
                     "in memory stops the run naming the chunk (default true); false skips the check on reads (every "
                     "chunk is still written with its checksum, and checkpoints are always verified)",
    "prefetch_depth": "layers read ahead of compute (0 reads on demand); default: what memory_limit allows (1-4)",
    "host_buffer_bytes": "bound on host staging buffers for NVMe I/O, e.g. 512MiB; default: from memory_limit",
    "memory_limit": "host memory the process may use, e.g. 2GiB; the engine derives its buffers and read-ahead "
                    "from it; default: the memory cgroup's limit or the available memory, less a margin",
    "sub_group_size": "update a layer in parts of at most this many parameters (each leaf whole), reading and "
                      "writing each part's optimizer state alone, as DeepSpeed's sub_group_size; default: one "
                      "update per layer, and parts only when memory_limit needs them",
    "tiles": "run each block's MLP over this many tiles of its hidden units and its attention over as many groups "
             "of heads, streamed tile by tile where a layer does not fit whole (stream_tiles; the parameters are "
             "the same); auto (default): untiled when the largest layer fits memory_limit, else the fewest tiles "
             "that fit",
    "stream_tiles": "how a layer whose blocks scan over tiles is streamed: auto (default) reads, writes and updates "
                    "it a whole layer at a time, its tiles computed in turn, whenever the memory budget holds the "
                    "layer, and tile by tile only when it does not; always streams it tile by tile",
    "lora_rank": "train LoRA adapters of this rank beside the lora_targets projections of every block, the base "
                 "model frozen (its update is zero); 0 (default): train every parameter",
    "lora_alpha": "the LoRA adapters' scale is lora_alpha / lora_rank (PEFT's lora_alpha); default 16",
    "lora_targets": "the projections that get adapters, comma-separated: any of q, k, v, o, up, gate, down "
                    "(gpt2 has no gate); default q,v",
    "lora_dropout": "dropout on the LoRA adapters' input while training (PEFT's lora_dropout), with the step's key "
                    "fold_in(key(seed), step); default 0",
    "update_on": "where the optimizer update runs: device, host (the host CPU, beside the optimizer state on host "
                 "or nvme: only gradients go down and the compute copy comes up) or auto (host when the optimizer "
                 "state is off an accelerator, device on the CPU backend)",
    "recompute": "rerun each layer's forward inside its backward (activation checkpointing): always; never (keep "
                 "every layer's backward residuals in device memory); or auto (never when the residuals fit the "
                 "memory budget with room to spare, else always)",
    "max_reuse_distance": "keep a layer's parameters from its forward for its backward when fewer than this many "
                          "parameters are read in between, as DeepSpeed's stage3_max_reuse_distance; 0: none kept; "
                          "default: those that fit beside the operations in between in what the largest "
                          "operation holds anyway (gpt2-small: the tied head's chunks)",
    "precision": "fp32, bf16 or fp16 compute (master weights stay fp32)",
    "grad_clip": "global-norm gradient clipping threshold; 0 is off",
    "grad_accum": "micro-batches per optimizer step",
    "mesh": "device mesh, e.g. data:4,model:2; -1 takes the remaining devices",
    "model": f"named model size ({', '.join(['gpt2-tiny', 'gpt2-small', '...', 'llama-7b'])}), a ModelConfig "
             "JSON/YAML file, or a zinfjax checkpoint directory whose model to train (zinfjax convert writes one)",
    "data": "demo (embedded corpus), a .bin uint16 token file, text (a .txt file, a directory of them or a glob), "
            "JSON Lines (.jsonl) or Parquet with a text field, or a datasets directory (save_to_disk); text is "
            "tokenized once by the model's tokenizer into a token file cached beside it (.zinfjax-tokens/)",
    "data_field": "the field (or column) holding the text in JSON Lines, Parquet or a datasets directory; default text",
    "tokenizer": "the tokenizer text is tokenized with (train, evaluate, generate): bytes, or a Hugging Face "
                 "tokenizer directory; default: the one zinfjax convert kept beside the model (<model>/tokenizer) or "
                 "beside the base an adapter run names, else bytes for a model made from a config",
    "steps": "optimizer steps to run",
    "batch_size": "sequences per optimizer step (split over micro-batches and the data axis); 0 with "
                  "micro_batch_size: micro_batch_size x grad_accum x data-parallel size",
    "micro_batch_size": "sequences per micro-step per data-parallel rank (DeepSpeed's "
                        "train_micro_batch_size_per_gpu); sets the global batch with grad_accum and the data axis",
    "seq_len": "tokens per sequence",
    "lr": "learning rate",
    "optimizer_name": f"optax optimizer: {', '.join(OPTIMIZERS)}",
    "weight_decay": "decoupled weight decay for adamw, lion, lamb and adafactor",
    "warmup_steps": "steps of learning-rate warmup from warmup_start_lr to lr (0: none)",
    "warmup_start_lr": "the learning rate the warmup starts from",
    "warmup_type": "linear, or log (DeepSpeed WarmupLR's default)",
    "lr_decay": "after the warmup: constant, linear or cosine decay to final_lr at the last step",
    "final_lr": "the learning rate at the last step of a linear or cosine decay",
    "seed": "seed of the initial parameters and of the data order, 0 to 2**63-1",
    "log": "path of the JSON log; a PNG loss curve is written beside it (checked writable before training)",
    "tensorboard_dir": "directory for TensorBoard event files of the per-step metrics (loss, lr, tokens/s, bytes "
                       "per tier, stall, overlap, io_floor_s, floor_ratio), written by process 0 (checked "
                       "writable before training); default: none",
    "max_nonfinite_steps": "consecutive steps with a NaN or inf loss after which the run stops with an error "
                           "(fp16 overflow steps that the loss scaler skips do not count)",
    "kv_cache": "tier of the KV cache of `zinfjax generate`: device, host or nvme",
    "save_dir": "checkpoint directory: <save_dir>/<step>/ (orbax layout; see docs/checkpoint.md)",
    "save_every": "save a checkpoint every N steps (0: only after the last step); needs save_dir",
    "keep_checkpoints": "how many of the newest checkpoints to keep",
    "resume": "true: continue from the newest complete, verified checkpoint in save_dir (under this run's mesh, "
              "stage and tiers); a step number: from that checkpoint",
    "overwrite": "start a new run in a save_dir that holds another run's checkpoints, moving them aside to "
                 "<save_dir>/.replaced-<time>/ (without it such a run is refused)",
    "allow_config_change": "resume even though seed, model, optimizer, lr, weight_decay, grad_clip, batch_size, "
                           "seq_len, grad_accum or data differ from the checkpoint's",
}
