"""Model sizes: one frozen dataclass, and the named sizes from tiny to several billion parameters."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from zinfjax._util.mapping_files import read_mapping
from zinfjax.errors import ConfigError
from zinfjax.models.lora import check_targets
from zinfjax.models.tiled import divisors
from zinfjax.models.vocab import vocab_chunks

ARCH_NAMES = ("gpt2", "llama", "bert")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a reference model.

    Example:
        >>> ModelConfig.named("gpt2-small").n_layers
        12
    """

    arch: str  # "gpt2", "llama" or "bert"
    vocab_size: int
    max_seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_kv_heads: int | None = None  # llama: grouped-query attention; None means n_heads
    tied: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    type_vocab_size: int = 2  # bert: token types (segments)
    vocab_chunks: int = 0  # row chunks the vocabulary table streams in; 0: about 8 MiB each (models/vocab.py)
    tiles: int = 1  # a block's MLP and attention run over this many tiles (models/tiling.py); the params are the same
    lora_rank: int = 0  # LoRA adapters of this rank beside the targeted projections (models/lora.py); 0: none
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank
    lora_targets: tuple[str, ...] = ("q", "v")  # any of models/lora.py's TARGETS
    lora_dropout: float = 0.0  # dropout on the adapters' input while training (PEFT's lora_dropout)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def chunks(self) -> int:
        """The row chunks of the vocabulary table: ``vocab_chunks``, or a count that keeps each about 8 MiB."""
        return self.vocab_chunks or vocab_chunks(self.vocab_size, self.d_model)

    @staticmethod
    def named(name: str) -> ModelConfig:
        """The named size ``name``; the error lists the names that exist."""
        if name not in NAMED:
            raise ConfigError(f"unknown model {name!r}; choose one of {', '.join(NAMED)}")
        return NAMED[name]

    @staticmethod
    def resolve(spec: str) -> ModelConfig:
        """A named size or a ModelConfig JSON/YAML file.

        A checkpoint directory (or save_dir) names a model too; `zinfjax.checkpoint.model.resolve_model`
        reads it, as models know no checkpoints (docs/design.md, the layering).

        Example:
            >>> ModelConfig.resolve("gpt2-tiny").n_layers
            4
        """
        if spec in NAMED:
            return NAMED[spec]
        if not os.path.isfile(spec):
            raise ConfigError(f"unknown model {spec!r}; choose one of {', '.join(NAMED)}, or give a ModelConfig "
                              "JSON/YAML file or a zinfjax checkpoint directory (zinfjax convert writes one)")
        return ModelConfig.from_dict(read_mapping(spec, "model file"), spec)

    @staticmethod
    def from_dict(values: dict, where: str = "the model") -> ModelConfig:
        """A `ModelConfig` from its fields; unknown or missing fields are named.

        Example:
            >>> ModelConfig.from_dict(dataclasses.asdict(NAMED["gpt2-tiny"])) == NAMED["gpt2-tiny"]
            True
        """
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigError(f"{where}: unknown ModelConfig field(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(fields))}")
        if values.get("arch") not in ARCH_NAMES:
            raise ConfigError(f"{where}: arch {values.get('arch')!r} is not one of {', '.join(ARCH_NAMES)}")
        try:
            return ModelConfig(**values)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from e

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))  # a list, from a checkpoint's JSON
        if self.lora_rank:
            check_lora(self)
        if self.tiles != 1 and self.tiles not in tile_counts(self):
            if self.arch == "bert":
                raise ConfigError(f"tiles={self.tiles}: BERT's blocks are not tiled; use tiles=1")
            check_tiles(self.tiles, tiled_dims(self))

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def check_lora(c: ModelConfig) -> None:
    """LoRA settings the model can take: a positive rank, targets it has, and an untiled block."""
    if c.lora_rank < 0:
        raise ConfigError(f"lora_rank={c.lora_rank} must be 0 (no adapters) or a positive rank")
    check_targets(c.arch, c.lora_targets)
    if not 0 <= c.lora_dropout < 1:
        raise ConfigError(f"lora_dropout={c.lora_dropout} must be at least 0 and below 1")
    if c.tiles != 1:
        raise ConfigError(f"lora_rank={c.lora_rank} with tiles={c.tiles}: LoRA adapters run in untiled blocks; "
                          "set tiles=1")


def tiled_dims(c: ModelConfig) -> dict[str, int]:
    """The dimensions a tile count cuts into equal parts (models/tiling.py's ``tile_view``): the MLP's hidden
    units, the query heads and the key-value heads (the GPT-2 and Llama blocks' ``_tiled``)."""
    return {"d_ff": c.d_ff, "n_heads": c.n_heads, "n_kv_heads": c.kv_heads}


def tile_counts(c: ModelConfig) -> list[int]:
    """The tile counts the model takes, fewest first: the common divisors of `tiled_dims`; 1 alone for BERT,
    whose blocks are not tiled. ``ModelConfig`` refuses any other count; the planners pick from these.

    Example:
        >>> tile_counts(NAMED["gpt2-tiny"])
        [1, 2, 4, 8]
        >>> tile_counts(NAMED["llama-1b"])       # grouped-query attention: 32 query heads share 4 key-value heads
        [1, 2, 4]
    """
    if c.arch == "bert":
        return [1]
    return divisors(math.gcd(*tiled_dims(c).values()))


def check_tiles(tiles: int, dims: dict[str, int]) -> None:
    """A tile count that divides every dimension it cuts; the error names the ones that work.

    Example:
        >>> check_tiles(3, {"d_ff": 256, "n_heads": 8})
        Traceback (most recent call last):
        ...
        zinfjax.errors.ConfigError: tiles=3 does not divide d_ff=256, n_heads=8; tile counts that divide ...: 1, 2, 4, 8
    """
    if tiles < 1:
        raise ConfigError(f"tiles={tiles} must be a positive count (or auto)")
    bad = [name for name, n in dims.items() if n % tiles]
    if bad:
        common = ", ".join(map(str, divisors(math.gcd(*dims.values()))))
        raise ConfigError(f"tiles={tiles} does not divide {', '.join(f'{b}={dims[b]}' for b in bad)}; tile counts "
                          f"that divide {', '.join(dims)}: {common}")


def _gpt2(vocab, ctx, d, layers, heads) -> ModelConfig:
    return ModelConfig("gpt2", vocab, ctx, d, layers, heads, 4 * d, tied=True)


def _llama(vocab, ctx, d, layers, heads, kv, ff, tied=False) -> ModelConfig:
    return ModelConfig("llama", vocab, ctx, d, layers, heads, ff, n_kv_heads=kv, tied=tied, norm_eps=1e-5)


NAMED: dict[str, ModelConfig] = {
    # Tiny sizes: byte vocabulary, heads and widths divisible by 8 so any mesh of up to 8 devices shards them.
    "gpt2-tiny": _gpt2(256, 128, 64, 4, 8),
    "gpt2-mini": _gpt2(256, 256, 256, 6, 8),
    "gpt2-small": _gpt2(50257, 1024, 768, 12, 12),
    "gpt2-medium": _gpt2(50257, 1024, 1024, 24, 16),
    "gpt2-large": _gpt2(50257, 1024, 1280, 36, 20),
    "gpt2-xl": _gpt2(50257, 1024, 1600, 48, 25),
    "llama-tiny": _llama(256, 128, 128, 4, 16, 8, 256),
    "llama-1b": _llama(32000, 2048, 2048, 22, 32, 4, 5632),
    "llama-7b": _llama(32000, 4096, 4096, 32, 32, 32, 11008),
}
