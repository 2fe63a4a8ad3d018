"""A DeepSpeed ZeRO checkpoint on disk: which files it has, and reading them without DeepSpeed.

DeepSpeed saves ``<save_dir>/latest`` (the tag) and ``<save_dir>/<tag>/`` (``global_stepN``) with:

- ``mp_rank_00_model_states.pt`` (stages 1, 2) or ``zero_pp_rank_{r}_mp_rank_00_model_states.pt``
  (stage 3, one per rank): the parameter names and shapes in flat order, the global step, the
  DeepSpeed config, tied parameters;
- ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt``, one per data-parallel rank: that rank's
  flat partitions of the fp32 master weights and of the optimizer state.

The pickles hold a few DeepSpeed classes (an enum, a loss scaler, fragment addresses). They are
read with ``torch.load(weights_only=True, mmap=True)``, those classes allowlisted by name as inert
stand-ins (`_Record`), so no DeepSpeed code, nor any other code, runs; tensors stay memory-mapped.

Example (on a DeepSpeed run's save dir, or one of its global_stepN dirs: only DeepSpeed writes one;
tests/interop/test_deepspeed.py makes them with real DeepSpeed runs):
    >>> ckpt = DeepSpeedCheckpoint.open("runs/ds")       # doctest: +SKIP
    >>> ckpt.stage, ckpt.world_size, ckpt.step           # doctest: +SKIP
    (3, 8, 1200)

A directory that holds none, or a rank's file short, is refused, naming what is missing:
    >>> import tempfile
    >>> DeepSpeedCheckpoint.open(tempfile.mkdtemp())
    Traceback (most recent call last):
    zinfjax_interop.errors.CheckpointFilesError: ... holds no DeepSpeed checkpoint: neither a 'latest' file nor ...
"""

from __future__ import annotations

import functools
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

from zinfjax_interop.errors import CheckpointFilesError, ConversionError

LATEST = "latest"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_12 = "mp_rank_00_model_states.pt"
_MODEL_3 = "zero_pp_rank_{r}_mp_rank_00_model_states.pt"


class UnsupportedCheckpointError(ConversionError):
    """A DeepSpeed checkpoint of a kind zinfjax does not convert (tensor, pipeline or expert parallel)."""


class _Record:
    """A DeepSpeed object in a pickle, read as plain data: its constructor arguments and attributes."""

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args = args
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots), as pickle's BUILD passes it
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


class _Stage(int):
    """DeepSpeed's ZeroStageEnum, read as its value."""


# Exactly the non-torch classes that DeepSpeed's checkpoints pickle, by their import path.
_SAFE = [
    (_Stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Record, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_Record, "argparse.Namespace"),  # Megatron-DeepSpeed keeps its command line in the model states
]


def load(path: str) -> dict[str, Any]:
    """One ``.pt`` file, tensors memory-mapped, with no code run from the pickle.

    Raises:
        CheckpointFilesError: naming the file, and the Python class that cannot be read safely.
    """
    import torch

    with torch.serialization.safe_globals(_SAFE):
        try:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # only the legacy (pre-zip) format cannot be mapped
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = f"a {found.group(1)}" if found else "Python objects"
            raise CheckpointFilesError(
                f"{path} holds {what}, which zinfjax does not unpickle (it reads checkpoints with "
                "torch.load(weights_only=True) so that no code in them runs)") from None
        except (RuntimeError, OSError, EOFError) as e:
            raise CheckpointFilesError(f"{path} cannot be read as a torch checkpoint: {e}") from None


@dataclass
class DeepSpeedCheckpoint:
    """The files of one tag of a DeepSpeed ZeRO checkpoint, checked for completeness when opened."""

    directory: str
    world_size: int  # data-parallel ranks: every parameter group's partition count
    optim_files: list[str]  # one per rank, in rank order
    model_files: list[str]  # stage 3: one per rank; stages 1-2: one

    @classmethod
    def open(cls, src: str) -> DeepSpeedCheckpoint:
        """Finds the checkpoint under ``src``: a save dir with ``latest``, or a ``global_stepN`` dir."""
        directory = _tag_dir(src)
        ranks, prefix = _optim_files(directory)
        first = ranks[min(ranks)]
        world = _world_size(_optimizer_state(load(first), first), first)
        want = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
        missing = [n for r, n in enumerate(want) if r not in ranks]
        extra = [os.path.basename(ranks[r]) for r in sorted(ranks) if r >= world]
        if missing or extra:
            raise CheckpointFilesError(
                f"{directory} was saved by {world} data-parallel ranks, but "
                + (f"lacks {', '.join(missing)}" if missing else f"also holds {', '.join(extra)}")
                + ": a rank did not save, or an older run's files were left behind")
        ckpt = cls(directory, world, [ranks[r] for r in range(world)], [])
        names = [_MODEL_3.format(r=r) for r in range(world)] if ckpt.stage == 3 else [_MODEL_12]
        missing = [n for n in names if not os.path.exists(os.path.join(directory, n))]
        if missing:
            raise CheckpointFilesError(f"{directory} lacks {', '.join(missing)}, which holds the parameter "
                                       "names and shapes")
        ckpt.model_files = [os.path.join(directory, n) for n in names]
        return ckpt

    @functools.cached_property
    def _optim_saved(self) -> list[dict]:
        return [load(path) for path in self.optim_files]

    @property
    def optim_states(self) -> list[dict]:
        """Each rank's ``optimizer_state_dict``, tensors memory-mapped."""
        return [_optimizer_state(saved, path) for saved, path in zip(self._optim_saved, self.optim_files, strict=True)]

    @functools.cached_property
    def model_states(self) -> list[dict]:
        return [load(path) for path in self.model_files]

    @functools.cached_property
    def stage(self) -> int:
        """The ZeRO stage: from the optimizer state, or the DeepSpeed config beside it."""
        state = self.optim_states[0]
        if "zero_stage" in state:
            return int(state["zero_stage"])
        if "fp32_flat_groups" in state:
            return 3
        stage = self.ds_config.get("zero_optimization", {}).get("stage", 1)  # BF16_Optimizer: stage 1
        return max(int(stage), 1)

    @property
    def ds_config(self) -> dict:
        config = self._optim_saved[0].get("ds_config")
        return config if isinstance(config, dict) else {}

    @property
    def step(self) -> int:
        """DeepSpeed's global step (optimizer steps taken, skipped fp16 steps included)."""
        steps = self.model_states[0].get("global_steps")
        if isinstance(steps, int):
            return steps
        m = re.search(r"(\d+)$", os.path.basename(self.directory))
        if m:
            return int(m.group(1))
        raise CheckpointFilesError(f"{self.model_files[0]} has no global_steps, and the directory name "
                                   f"{os.path.basename(self.directory)} has no step number")


def _optim_files(directory: str) -> tuple[dict[int, str], str]:
    """The optimizer files by rank, and their name prefix (``bf16_`` or none)."""
    ranks, prefixes = {}, set()
    for name in sorted(os.listdir(directory)):
        m = _OPTIM.match(name)
        if not m:
            continue
        if m.group(3) != "00":
            raise UnsupportedCheckpointError(
                f"{directory} holds {name}: a tensor-parallel DeepSpeed checkpoint (mp_rank > 0); "
                "zinfjax converts data-parallel ZeRO checkpoints only")
        ranks[int(m.group(2))] = os.path.join(directory, name)
        prefixes.add(m.group(1) or "")
    if not ranks:
        pipeline = [n for n in sorted(os.listdir(directory)) if n.startswith("layer_")]
        if pipeline:
            raise UnsupportedCheckpointError(f"{directory} holds {pipeline[0]}: a pipeline-parallel DeepSpeed "
                                             "checkpoint, which zinfjax does not convert")
        raise CheckpointFilesError(f"{directory} has no *_optim_states.pt files: it is not a DeepSpeed "
                                   "ZeRO checkpoint, or its optimizer state was not saved")
    if len(prefixes) > 1:
        raise CheckpointFilesError(f"{directory} mixes bf16_zero_* and zero_* optimizer files: two runs "
                                   "wrote into one tag; keep one run's files")
    return ranks, prefixes.pop()


def _world_size(state: dict, path: str) -> int:
    counts = state.get("partition_count")
    counts = list(counts) if isinstance(counts, list | tuple) else [counts]
    if not counts or any(not isinstance(c, int) for c in counts):
        raise CheckpointFilesError(f"{path} has no partition_count: it is not a ZeRO optimizer file")
    if len(set(counts)) > 1:
        raise UnsupportedCheckpointError(
            f"{path}: its parameter groups are partitioned over {sorted(set(counts))} ranks (expert "
            "parallelism, MoE); zinfjax converts dense data-parallel checkpoints only")
    return counts[0]


def _optimizer_state(saved: Any, path: str) -> dict:
    state = saved.get("optimizer_state_dict") if isinstance(saved, dict) else None
    if not isinstance(state, dict):
        raise CheckpointFilesError(f"{path} has no optimizer_state_dict: it is not a DeepSpeed optimizer file")
    return state


def _tag_dir(src: str) -> str:
    if not os.path.isdir(src):
        raise CheckpointFilesError(f"{src} is not a directory; pass a DeepSpeed save dir (with a 'latest' "
                                   "file) or one of its global_stepN directories")
    latest = os.path.join(src, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        directory = os.path.join(src, tag)
        if not os.path.isdir(directory):
            raise CheckpointFilesError(f"{latest} names the tag {tag!r}, but {directory} does not exist")
        return directory
    if any(_OPTIM.match(n) for n in os.listdir(src)):
        return src
    tags = sorted(n for n in os.listdir(src) if os.path.isdir(os.path.join(src, n)) and n.startswith("global_step"))
    if tags:
        raise CheckpointFilesError(f"{src} has no 'latest' file; pass one of its checkpoints: "
                                   + ", ".join(os.path.join(src, t) for t in tags))
    raise CheckpointFilesError(f"{src} holds no DeepSpeed checkpoint: neither a 'latest' file nor "
                               "*_optim_states.pt files")
