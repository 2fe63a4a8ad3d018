"""DeepSpeed ZeRO checkpoints (stages 1-3, any data-parallel size) to zinfjax checkpoints that resume training.

This is DeepSpeed's ``zero_to_fp32.py`` plus the optimizer half of its universal checkpoint,
without torch.distributed and without importing DeepSpeed: the fp32 master weights and Adam's
``exp_avg`` / ``exp_avg_sq`` are rebuilt from every rank's flat partitions (`zinfjax_interop.ds_partitions`),
one parameter at a time, renamed and re-laid-out by the Hugging Face tables (`zinfjax_interop.tables`, as
`zinfjax_interop.hf` does for HF checkpoints), and written leaf by leaf with `CheckpointWriter`:

| DeepSpeed | zinfjax checkpoint |
|---|---|
| fp32 master weights | ``params`` (fp32) |
| ``exp_avg`` / ``exp_avg_sq`` | ``opt_state`` ``mu`` / ``nu`` of optax's adamw, per group |
| the optimizer's ``step`` | ``opt_state`` ``count`` (every layer) |
| ``global_steps`` | the checkpoint's step and data position |
| lr, weight decay, stage, bf16/fp16, clipping | the recorded `Config` |

Example (on a DeepSpeed run's save dir: only DeepSpeed writes one; tests/interop/test_deepspeed.py makes them
with real DeepSpeed runs):
    >>> convert_deepspeed("runs/ds", "runs/zinfjax", "runs/ds/config.json")   # doctest: +SKIP
    {'path': 'runs/zinfjax/1200', 'step': 1200, 'stage': 3, 'world_size': 8, ...}
    >>> zinfjax.wrap(train_state, config, restore="runs/zinfjax")            # doctest: +SKIP

A directory that holds none is refused before anything is written:
    >>> import tempfile
    >>> convert_deepspeed(tempfile.mkdtemp(), tempfile.mkdtemp())
    Traceback (most recent call last):
    zinfjax_interop.errors.CheckpointFilesError: ... holds no DeepSpeed checkpoint: neither a 'latest' file nor ...
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from zinfjax._util.mapping_files import read_mapping
from zinfjax.checkpoint import CheckpointWriter, expected_leaves
from zinfjax.config import Config
from zinfjax.models import ModelConfig
from zinfjax.models.configs import NAMED
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax_interop.ds_adam import AdamSettings, UnsupportedOptimizerError, adam_settings
from zinfjax_interop.ds_checkpoint import DeepSpeedCheckpoint, UnsupportedCheckpointError
from zinfjax_interop.ds_partitions import KINDS, Partitions
from zinfjax_interop.errors import (
    CheckpointFilesError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
)
from zinfjax_interop.hf import _Entry, _expected, _hf_shape, _layer_shape, _some, zinfjax_shapes
from zinfjax_interop.hf_config import from_hf_config
from zinfjax_interop.tables import BY_ARCH, FUSE_AXIS, ArchTable, hf_shape, to_zinfjax

MOMENTS = {"exp_avg": "mu", "exp_avg_sq": "nu"}


def convert_deepspeed(src: str, dst: str, model_config: ModelConfig | str | None = None, *, progress: bool = False,
                      lr: float | None = None, weight_decay: float | None = None) -> dict:
    """Converts the DeepSpeed ZeRO checkpoint at ``src`` into a zinfjax checkpoint under ``dst``.

    Args:
        src: a DeepSpeed save dir (with a ``latest`` file) or one of its ``global_stepN`` dirs.
        dst: the zinfjax save dir; the checkpoint is ``dst/<step>``, visible only once complete.
        model_config: the model: a `ModelConfig`, or an HF ``config.json`` or the directory holding it;
            by default the ``config.json`` beside the checkpoint (where HF's Trainer saves it).
        progress: show a progress bar.
        lr, weight_decay: override the optimizer's, e.g. where parameter groups differ.

    Returns:
        A summary: ``path``, ``step``, ``adam_step``, ``stage``, ``world_size``, ``precision``,
        ``dtype``, ``tensors`` (DeepSpeed parameters), ``leaves``, ``bytes``, ``lr``, ``weight_decay``.

    Raises:
        CheckpointFilesError, UnsupportedCheckpointError: a rank's file missing, a kind of checkpoint
            (tensor, pipeline, expert parallel) not converted; each names the file.
        MissingTensorError, UnexpectedTensorError, ShapeMismatchError: naming the tensor.
        UnsupportedOptimizerError: not AdamW with optax's betas and eps; names the setting.
    """
    ckpt = DeepSpeedCheckpoint.open(src)
    model = _model_config(model_config, src, ckpt)
    parts = Partitions.of(ckpt)
    plan = _plan(parts, model, ckpt)
    adam = adam_settings(parts.param_groups, ckpt.ds_config, ckpt.directory, lr, weight_decay)
    if len(parts.steps) > 1:
        raise UnsupportedCheckpointError(f"{ckpt.directory}: the optimizer's step counts differ between parameter "
                                         f"groups or ranks ({sorted(parts.steps)}); zinfjax keeps one")
    count = parts.steps.pop() if parts.steps else 0
    config = _config(ckpt, adam, model)
    leaves = expected_leaves(_abstract(model), make_optimizer(config.replace(grad_clip=0.0)))
    moments, counts = _opt_names(leaves)
    writer = CheckpointWriter(dst, ckpt.step, leaves, config=config, model=model, data_position=ckpt.step)
    try:
        for name, entry in _progress(plan, progress):
            for kind in KINDS:
                for zpath, layer, array in _zinfjax_tensors(entry, parts.read(name, kind), model):
                    leaf = zpath.replace("/", ".")
                    item, leaf = ("params", leaf) if kind == "fp32" else ("opt_state", moments[MOMENTS[kind], leaf])
                    writer.write(item, leaf, layer, array)
        for leaf in counts:
            writer.write("opt_state", leaf, None, np.asarray(count, np.int32))
        path = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {
        "path": path, "step": ckpt.step, "adam_step": count, "stage": ckpt.stage, "world_size": ckpt.world_size,
        "precision": config.precision, "dtype": "float32", "tensors": len(plan),
        "leaves": sum(len(v) for v in leaves.values()), "bytes": writer.bytes_written,
        "lr": adam.lr, "weight_decay": adam.weight_decay,
    }


def _model_config(given, src: str, ckpt: DeepSpeedCheckpoint) -> ModelConfig:
    if isinstance(given, ModelConfig):
        return given
    if given is None:
        places = [src, ckpt.directory, os.path.dirname(os.path.abspath(src))]
        found = next((os.path.join(p, "config.json") for p in places if os.path.isfile(os.path.join(p, "config.json"))),
                     None)
        if found is None:
            raise CheckpointFilesError(f"no config.json beside the DeepSpeed checkpoint {ckpt.directory}: pass the "
                                       "model's Hugging Face config.json (or its directory, or a ModelConfig)")
        given = found
    path = os.path.join(given, "config.json") if os.path.isdir(given) else given
    if not os.path.isfile(path):
        raise CheckpointFilesError(f"{path} does not exist: the model's Hugging Face config.json is needed")
    return from_hf_config(read_mapping(path, "the model's Hugging Face config", CheckpointFilesError))


def _plan(parts: Partitions, model: ModelConfig, ckpt: DeepSpeedCheckpoint) -> list[tuple[str, _Entry]]:
    """Every DeepSpeed parameter with its table rule, checked whole (names, shapes) before anything is read."""
    if model.arch not in BY_ARCH:
        raise UnknownArchitectureError(f"zinfjax cannot convert arch {model.arch!r}; supported: {', '.join(BY_ARCH)}")
    table = BY_ARCH[model.arch]
    outer, body = _prefixes(table, parts.names)
    names = {n[len(outer):]: n for n in parts.names if n.startswith(outer)}
    expected = _expected(table, model, body)
    where = f"{ckpt.directory} ({model.arch}, {model.n_layers} layers)"
    missing = [outer + n for n, e in expected.items() if e.rule.paths and n not in names]
    if missing:
        raise MissingTensorError(f"{where} lacks {_some(missing)}")
    unexpected = [n for n in parts.names if not n.startswith(outer) or n[len(outer):] not in expected]
    if unexpected:
        raise UnexpectedTensorError(f"{where} holds parameters that zinfjax does not map: {_some(unexpected)}")
    dropped = [full for n, full in names.items() if not expected[n].rule.paths]
    if dropped:
        raise UnexpectedTensorError(f"{where}: {_some(dropped)} trained by DeepSpeed, but zinfjax's {model.arch} "
                                    "model has no such parameter (e.g. an untied lm_head with a tied config.json)")
    shapes = zinfjax_shapes(model)
    for n, full in names.items():
        want, got = _hf_shape(expected[n], shapes), parts.shape(full)
        if got != want:
            raise ShapeMismatchError(f"{where}: parameter {full} has shape {got}, but the model config implies {want}")
    return [(full, expected[n]) for n, full in names.items()]


def _prefixes(table: ArchTable, names: list[str]) -> tuple[str, str]:
    """(outer, body): a wrapper's prefix around the HF model (``module.``, usually none), and the HF body's."""
    first = table.rules[0].hf  # the embedding, found under every body
    for name in names:
        if name.endswith(first):
            full = name[:-len(first)]
            for body in sorted(table.bodies, key=len, reverse=True):  # "transformer." before ""
                if full.endswith(body):
                    return full[:len(full) - len(body)], body
    return "", table.bodies[0]


def _zinfjax_tensors(entry: _Entry, a: np.ndarray, model: ModelConfig):
    """An HF-named array as zinfjax leaves: ``(path, layer, array)``; a fused tensor gives its parts."""
    rule, shapes = entry.rule, zinfjax_shapes(model)
    zshapes = [_layer_shape(shapes, p) for p in rule.paths]
    axis = FUSE_AXIS[rule.layout]
    sizes = [hf_shape(rule.layout, z, rule.in_axes)[axis] for z in zshapes]
    pieces = np.split(a, np.cumsum(sizes)[:-1], axis=axis) if len(sizes) > 1 else [a]
    for path, piece, zshape in zip(rule.paths, pieces, zshapes, strict=True):
        yield path, entry.layer, to_zinfjax(rule.layout, piece, zshape)


def _abstract(model: ModelConfig):
    flat = {p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in zinfjax_shapes(model).items()}
    return traverse_util.unflatten_dict(flat, sep="/")


def _opt_names(leaves) -> tuple[dict[tuple[str, str], str], list[str]]:
    """optax adamw's leaves: ``{("mu", "blocks.q.kernel"): "0.mu.blocks.q.kernel", ...}`` and the count leaves."""
    moments, counts = {}, []
    for name in leaves["opt_state"]:
        m = re.fullmatch(r"(\d+)\.(mu|nu)\.(.+)", name)
        if m:
            moments[m[2], m[3]] = name
        elif re.fullmatch(r"(\d+)\.count", name):
            counts.append(name)
        else:  # a bug: make_optimizer's adamw no longer has optax's ScaleByAdamState layout
            raise AssertionError(f"unexpected adamw state leaf {name}")
    return moments, counts


def _config(ckpt: DeepSpeedCheckpoint, adam: AdamSettings, model: ModelConfig) -> Config:
    ds = ckpt.ds_config

    def enabled(*keys):
        return any((ds.get(k) or {}).get("enabled") in (True, "auto") for k in keys)

    def integer(key, default):
        value = ds.get(key, default)
        return value if isinstance(value, int) and value > 0 else default

    accum = integer("gradient_accumulation_steps", 1)
    micro = integer("train_micro_batch_size_per_gpu", 0)
    clip = ds.get("gradient_clipping", 0.0)
    name = next((n for n, m in NAMED.items() if m == model), Config().model)
    return Config(
        stage=ckpt.stage, precision="bf16" if enabled("bf16", "bfloat16") else "fp16" if enabled("fp16") else "fp32",
        grad_clip=float(clip) if isinstance(clip, int | float) else 0.0, grad_accum=accum,
        batch_size=micro * ckpt.world_size * accum if micro else Config().batch_size,
        optimizer_name="adamw", lr=adam.lr, weight_decay=adam.weight_decay, model=name,
    )


def _progress(plan, show: bool):
    if not show:
        return plan
    from tqdm import tqdm

    return tqdm(plan, desc="converting", unit="tensor")


__all__ = ["UnsupportedCheckpointError", "UnsupportedOptimizerError", "convert_deepspeed"]
