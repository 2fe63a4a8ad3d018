"""A run's settings by concern: small frozen sections of `zinfjax.config.Config`'s flat keys.

`Config` is the user's record of a run: one flat set of keys (docs/config.md), read from files, ``--set``
and DeepSpeed configs, and saved in checkpoints as given. The layers below it (`zinfjax.engine`,
`zinfjax.store`, `zinfjax.program`) never see it: a caller hands each the sections it reads
(`Config.section`, `Config.engine_settings`), and what a layer derives from them (a memory budget's
read-ahead, where the update runs) stays in that layer's own plan. Each key belongs to one section
(`SECTIONS`), under its own name, with the default `Config` gives it.

Example:
    >>> Memory(memory_limit=2 << 30).replace(prefetch_depth=2).prefetch_depth
    2
    >>> Tiering(optimizer="host:12,nvme", nvme_path="/nv").uses_nvme
    True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from zinfjax._util.choices import TIER_KEYS
from zinfjax._util.tier_split import tiers_in


@dataclass(frozen=True)
class Section:
    """A frozen group of config keys, each under its `Config` name."""

    def replace(self, **changes) -> Any:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The section's keys and values, as `Config.to_dict` spells them."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Tiering(Section):
    """Where the state lives: the ZeRO stage, each part's tier (or split by layer), the NVMe path, where the update
    runs."""

    stage: int = 0
    params: str = "device"
    optimizer: str = "device"
    gradients: str = "device"
    activations: str = "device"
    kv_cache: str = "device"
    tiers: str = "default"
    nvme_path: str | None = None
    verify_chunks: bool = True
    update_on: str = "auto"

    @property
    def uses_nvme(self) -> bool:
        """Whether a tier key (or ``kv_cache``) puts anything on NVMe."""
        return self.kv_cache == "nvme" or any("nvme" in tiers_in(getattr(self, k)) for k in TIER_KEYS)


@dataclass(frozen=True)
class Memory(Section):
    """The host memory budget and what the engine holds within it: buffers, read-ahead, update parts, recomputation,
    reuse, and whether a tiled layer streams tile by tile. None: the engine's budget decides
    (`zinfjax.engine.budget`)."""

    memory_limit: int | None = None
    host_buffer_bytes: int | None = None
    prefetch_depth: int | None = None
    sub_group_size: int | None = None
    recompute: str = "auto"
    max_reuse_distance: int | None = None
    stream_tiles: str = "auto"


@dataclass(frozen=True)
class Numerics(Section):
    """The compute precision, and the micro-batches each step accumulates."""

    precision: str = "fp32"
    grad_accum: int = 1


@dataclass(frozen=True)
class Model(Section):
    """The model a run trains: its name, size or checkpoint, its tiles and its LoRA adapters."""

    model: str = "gpt2-tiny"
    tiles: str = "auto"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = "q,v"
    lora_dropout: float = 0.0


@dataclass(frozen=True)
class Data(Section):
    """What the model is fed: the data, its field and tokenizer, and the batch."""

    data: str = "demo"
    data_field: str = "text"
    tokenizer: str | None = None
    batch_size: int = 8
    micro_batch_size: int | None = None
    seq_len: int = 64


@dataclass(frozen=True)
class Optimization(Section):
    """The optimizer and its learning-rate schedule."""

    optimizer_name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    warmup_steps: int = 0
    warmup_start_lr: float = 0.0
    warmup_type: str = "linear"
    lr_decay: str = "constant"
    final_lr: float = 0.0


@dataclass(frozen=True)
class Run(Section):
    """The run itself: its steps, seed and mesh, what it logs, and when it gives up on a non-finite loss."""

    steps: int = 100
    seed: int = 0
    mesh: str = "data:-1"
    log: str | None = None
    tensorboard_dir: str | None = None
    max_nonfinite_steps: int = 3


@dataclass(frozen=True)
class Checkpointing(Section):
    """Where and how often checkpoints are saved, how many are kept, and how a run continues from one."""

    save_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool | int = False
    overwrite: bool = False
    allow_config_change: bool = False


# Every key of a `Config` is in exactly one of these (tests/test_config.py checks it).
SECTIONS = (Tiering, Memory, Numerics, Model, Data, Optimization, Run, Checkpointing)


@dataclass(frozen=True)
class EngineSettings(Section):
    """What an engine is built from besides its program, optimizer and mesh: the sections it reads, as the user gave
    them, and the seed of its steps' keys (`Config.engine_settings`)."""

    tiering: Tiering = field(default_factory=Tiering)
    memory: Memory = field(default_factory=Memory)
    numerics: Numerics = field(default_factory=Numerics)
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The settings as flat config keys."""
        return {**self.tiering.to_dict(), **self.memory.to_dict(), **self.numerics.to_dict(), "seed": self.seed}
