"""DeepSpeed's flat fp32 partitions, and the Adam moments beside them, back into whole tensors.

ZeRO keeps each parameter group flattened into one fp32 vector, split over the data-parallel ranks:

- **stages 1 and 2**: a group's vector (its parameters in ``param_shapes`` order, each followed by
  its alignment padding) is cut into ``world_size`` consecutive pieces; rank r holds piece r, and
  only the last piece has padding at its end;
- **stage 3**: each parameter is padded to a multiple of ``world_size`` and cut into equal pieces;
  rank r's vector (its sub-groups, one after another) holds piece r of every parameter, in order.

That is the layout ``deepspeed/utils/zero_to_fp32.py`` reads. The optimizer's ``exp_avg`` and
``exp_avg_sq`` have the same layout as the fp32 weights, so they are read the same way. Every read
slices memory-mapped partitions and copies one parameter.

Example (on a DeepSpeed run's save dir: only DeepSpeed writes one; tests/interop/test_deepspeed.py makes them
with real DeepSpeed runs):
    >>> parts = Partitions.of(DeepSpeedCheckpoint.open("runs/ds"))                 # doctest: +SKIP
    >>> parts.read("transformer.h.0.attn.c_attn.weight", "exp_avg").shape         # doctest: +SKIP
    (768, 2304)

The checkpoint is checked whole when it is opened, before any partition is read:
    >>> import tempfile
    >>> Partitions.of(DeepSpeedCheckpoint.open(tempfile.mkdtemp()))
    Traceback (most recent call last):
    zinfjax_interop.errors.CheckpointFilesError: ... holds no DeepSpeed checkpoint: neither a 'latest' file nor ...
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zinfjax_interop.ds_adam import UnsupportedOptimizerError
from zinfjax_interop.ds_checkpoint import DeepSpeedCheckpoint
from zinfjax_interop.errors import CheckpointFilesError, ShapeMismatchError

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


class _Vector:
    """Arrays read as one vector (a group's pieces over ranks, or a rank's sub-groups)."""

    def __init__(self, pieces: Sequence[np.ndarray]):
        self.pieces = list(pieces)
        self.starts = [0, *np.cumsum([len(p) for p in self.pieces]).tolist()]

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, a: int, b: int) -> list[np.ndarray]:
        out = []
        for piece, start in zip(self.pieces, self.starts, strict=False):
            lo, hi = max(a, start), min(b, start + len(piece))
            if lo < hi:
                out.append(piece[lo - start:hi - start])
        return out


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lies: ``(vector, start, stop)`` segments, joined and cut to ``numel``."""

    shape: tuple[int, ...]
    segments: tuple[tuple[int, int, int], ...]


@dataclass
class Partitions:
    """Every trainable parameter of a ZeRO checkpoint, readable whole, one at a time.

    ``vectors[kind]`` are the flat vectors (per group for stages 1-2, per rank for stage 3);
    ``steps`` the optimizer step counts found; ``param_groups`` the torch optimizer's groups.
    """

    shapes: dict[str, tuple[int, ...]]
    slots: dict[str, _Slot]
    vectors: dict[str, list[_Vector]]
    frozen: dict[str, np.ndarray]
    steps: set[int]
    param_groups: list[dict]

    @classmethod
    def of(cls, ckpt: DeepSpeedCheckpoint) -> Partitions:
        model = ckpt.model_states[0]
        shapes = model.get("param_shapes")
        groups = [shapes] if isinstance(shapes, dict) else list(shapes or [])
        if not groups:
            raise CheckpointFilesError(f"{ckpt.model_files[0]} has no param_shapes: it is not a ZeRO model state")
        groups = [{n: tuple(int(d) for d in s) for n, s in g.items()} for g in groups]
        ranks = [_rank_state(s, f, ckpt.stage) for s, f in zip(ckpt.optim_states, ckpt.optim_files, strict=True)]
        build = _zero3 if ckpt.stage == 3 else _zero12
        slots, vectors = build(groups, ranks, ckpt)
        return cls({n: s for g in groups for n, s in g.items()}, slots, vectors, _frozen(ckpt),
                   {s for r in ranks for s in r.steps}, ranks[0].param_groups)

    @property
    def names(self) -> list[str]:
        """Parameter names in flat order, frozen ones last."""
        return [*self.slots, *self.frozen]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name] if name in self.shapes else tuple(self.frozen[name].shape)

    def read(self, name: str, kind: str) -> np.ndarray:
        """One parameter's fp32 master weight, exp_avg or exp_avg_sq, whole, as a float32 array."""
        if name in self.frozen:  # not trained by DeepSpeed: no optimizer state
            a = self.frozen[name]
            return a.copy() if kind == "fp32" else np.zeros_like(a)
        slot = self.slots[name]
        parts = [p for v, a, b in slot.segments for p in self.vectors[kind][v].read(a, b)]
        flat = np.concatenate(parts) if len(parts) != 1 else parts[0].copy()
        return flat[:math.prod(slot.shape)].reshape(slot.shape)


@dataclass
class _Rank:
    """One rank's flat vectors per group (stages 1-2) or sub-group (stage 3), padding removed."""

    fp32: list[np.ndarray]
    exp_avg: list[np.ndarray]
    exp_avg_sq: list[np.ndarray]
    steps: set[int]
    param_groups: list[dict]


def _rank_state(state: dict, path: str, stage: int) -> _Rank:
    if stage == 3:
        fp32 = [_numpy(t) for t in state["fp32_flat_groups"]]
        torch_state = state.get("optimizer_state_dict") or {}
        groups = torch_state.get("param_groups", [])
        adam = [torch_state.get("state", {}).get(i, {}) for g in groups for i in g["params"]]
    else:
        fp32 = [_numpy(t) for t in state["single_partition_of_fp32_groups"]]
        if "zero_stage" not in state:  # BF16_Optimizer keeps the padding, ZeRO's optimizer removes it
            fp32 = [t[:len(t) - pad] for t, pad in zip(fp32, state.get("group_paddings", []), strict=True)]
        base = state.get("base_optimizer_state") or {}
        if isinstance(base, list):  # elastic checkpoint: a lean state per group, no param_groups
            groups, adam = [], base
        else:
            groups = base.get("param_groups", [])
            adam = [base.get("state", {}).get(g["params"][0], {}) for g in groups]
    if not adam:
        adam = [{} for _ in fp32]
    if len(adam) != len(fp32):
        raise CheckpointFilesError(f"{path} holds {len(fp32)} fp32 partitions but optimizer state for {len(adam)}")
    moments = {k: [] for k in ("exp_avg", "exp_avg_sq")}
    for i, (weights, s) in enumerate(zip(fp32, adam, strict=True)):
        if s and not set(moments) <= set(s):
            raise UnsupportedOptimizerError(f"{path}: the optimizer state of group {i} holds {', '.join(sorted(s))}, "
                                            "not Adam's exp_avg and exp_avg_sq")
        for k in moments:
            m = _numpy(s[k]) if k in s else np.zeros_like(weights)
            if len(m) < len(weights):
                raise ShapeMismatchError(f"{path}: the {k} of group {i} holds {len(m)} numbers, its fp32 "
                                         f"partition {len(weights)}")
            moments[k].append(m[:len(weights)])
    steps = {int(float(s["step"])) for s in adam if "step" in s}
    return _Rank(fp32, moments["exp_avg"], moments["exp_avg_sq"], steps, list(groups))


def _zero12(groups: list[dict], ranks: list[_Rank], ckpt: DeepSpeedCheckpoint):
    """Stages 1-2: group g's vector is the ranks' pieces one after another."""
    if any(len(r.fp32) != len(groups) for r in ranks):
        raise CheckpointFilesError(f"{ckpt.directory}: the optimizer files hold {len(ranks[0].fp32)} parameter "
                                   f"groups, {ckpt.model_files[0]} names {len(groups)}")
    vectors = {k: [_Vector([getattr(r, k)[g] for r in ranks]) for g in range(len(groups))] for k in KINDS}
    paddings = ckpt.optim_states[0].get("param_alignment_paddings")
    align = 2 * ckpt.world_size  # DeepSpeed pads each group to a multiple of this
    slots = {}
    for g, shapes in enumerate(groups):
        pads = paddings[g] if paddings else [0] * len(shapes)
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads, strict=True):
            n = math.prod(shape)
            slots[name] = _Slot(shape, ((g, offset, offset + n),))
            offset += n + pad
        have = len(vectors["fp32"][g])
        if _ceil(offset, align) != _ceil(have, align):
            raise ShapeMismatchError(f"{ckpt.directory}: parameter group {g} holds {have} numbers over "
                                     f"{ckpt.world_size} ranks, but its param_shapes need {offset}")
    return slots, vectors


def _zero3(groups: list[dict], ranks: list[_Rank], ckpt: DeepSpeedCheckpoint):
    """Stage 3: every rank's vector holds a ceil(numel / world_size) piece of each parameter."""
    world = ckpt.world_size
    vectors = {k: [_Vector(getattr(r, k)) for r in ranks] for k in KINDS}
    slots, offset = {}, 0
    for name, shape in ((n, s) for g in groups for n, s in g.items()):
        piece = _ceil(math.prod(shape), world) // world
        slots[name] = _Slot(shape, tuple((r, offset, offset + piece) for r in range(world)))
        offset += piece
    for r, v in enumerate(vectors["fp32"]):
        if len(v) != offset:
            raise ShapeMismatchError(f"{ckpt.optim_files[r]} holds {len(v)} numbers, but the param_shapes of "
                                     f"{ckpt.model_files[0]} need {offset} per rank")
    return slots, vectors


def _frozen(ckpt: DeepSpeedCheckpoint) -> dict[str, np.ndarray]:
    """Parameters DeepSpeed did not train (requires_grad False): whole in the model states (stage 3: per rank)."""
    shapes = ckpt.model_states[0].get("frozen_param_shapes") or {}
    out = {}
    for name, shape in shapes.items():
        frags = [_numpy(m["frozen_param_fragments"][name]).reshape(-1) for m in ckpt.model_states]
        out[name] = np.concatenate(frags)[:math.prod(shape)].reshape(tuple(shape))
    return out


def _numpy(t) -> np.ndarray:
    """A float32 view of a (memory-mapped) torch tensor, flattened; a copy only for other dtypes."""
    import torch

    t = t.detach()
    return (t if t.dtype == torch.float32 else t.float()).reshape(-1).numpy()


def _ceil(x: int, m: int) -> int:
    return m * math.ceil(x / m)
