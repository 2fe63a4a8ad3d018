"""PEFT LoRA adapters: a zinfjax LoRA checkpoint as a PEFT adapter directory and back, or merged into its base.

zinfjax's adapter of a projection (`zinfjax.models.lora`) is PEFT's plain LoRA: ``a`` ``(in..., r)`` is
``lora_A.weight`` ``(r, in)`` and ``b`` ``(r, out...)`` is ``lora_B.weight`` ``(out, r)``, both laid out
as the projection's own kernel is (`Layout.LINEAR` of `zinfjax_interop.tables`), scaled by
``lora_alpha / r``. Llama's projections are one ``nn.Linear`` each in Hugging Face, so its adapters map
one to one; GPT-2's ``c_attn`` fuses q, k and v, where no PEFT adapter equals zinfjax's three, so a
GPT-2 adapter is exported merged (`Merged`) or not at all.

| direction | files |
|---|---|
| `write_peft` | ``adapter_config.json`` + ``adapter_model.safetensors``, for ``PeftModel.from_pretrained`` |
| `import_peft` | a zinfjax checkpoint ``DST/0`` of the adapter leaves alone, naming its base (`base_ref`) |
| `Merged` | the base's leaves with ``W + (alpha / r) A B`` folded into each adapted kernel (``--to hf --merge``) |

Example (a random llama-tiny as the base, and a fine-tune of its q and v adapters):
    >>> import tempfile
    >>> from zinfjax.checkpoint.writer import write_params
    >>> from zinfjax_interop.convert import ZinfjaxCheckpoint
    >>> from zinfjax_interop.hf import zinfjax_shapes
    >>> llama, rng = ModelConfig.named("llama-tiny"), np.random.default_rng(0)
    >>> lora = llama.replace(lora_rank=4, lora_targets=("q", "v"))
    >>> weights = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(llama).items()}
    >>> adapters = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in adapter_shapes(lora).items()}
    >>> base = write_params(tempfile.mkdtemp(), traverse_util.unflatten_dict(weights, sep="/"), model=llama)
    >>> tuned = write_params(tempfile.mkdtemp(), traverse_util.unflatten_dict({**weights, **adapters}, sep="/"),
    ...                      model=lora)
    >>> adapter_dir = tempfile.mkdtemp()
    >>> with ZinfjaxCheckpoint(tuned) as src:
    ...     _ = write_peft(src, adapter_dir)         # PeftModel.from_pretrained(llama, adapter_dir) loads it
    >>> sorted(os.listdir(adapter_dir))
    ['adapter_config.json', 'adapter_model.safetensors']
    >>> again = import_peft(adapter_dir, tempfile.mkdtemp(), base=base, lr=3e-4)   # its adapters, naming the base
    >>> with ZinfjaxCheckpoint(again["path"]) as ckpt:
    ...     bool((ckpt.read("blocks/q_lora/a", 2) == adapters["blocks/q_lora/a"][2]).all())
    True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from zinfjax import models
from zinfjax.checkpoint import CheckpointWriter, expected_leaves
from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.base import base_ref
from zinfjax.checkpoint.model import checkpoint_model
from zinfjax.checkpoint.snapshot import leaf_name
from zinfjax.config import Config
from zinfjax.models import ModelConfig
from zinfjax.models.lora import MODULES, SUFFIX, TARGETS, is_adapter
from zinfjax_interop.errors import AdapterError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from zinfjax_interop.files import SafetensorsWriter, StateDictFile
from zinfjax_interop.hf import _write_json
from zinfjax_interop.tables import BY_ARCH, Layout, Rule, hf_shape, to_hf, to_zinfjax

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # what save_pretrained writes, in its order
PREFIX = "base_model.model."  # a PeftModel's names: its LoraModel's model, then the transformers model's own
# PEFT settings beyond plain LoRA; each is refused when set (true, or not empty), naming it.
VARIANTS = ("use_rslora", "use_dora", "lora_bias", "modules_to_save", "layers_to_transform", "rank_pattern",
            "alpha_pattern", "layer_replication", "trainable_token_indices", "target_parameters", "use_qalora",
            "alora_invocation_tokens")
_LORA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name.startswith("lora_")}


class _Entry(NamedTuple):
    """One PEFT tensor: its name, the zinfjax leaf and layer it holds, and that leaf's layout as a kernel."""

    name: str
    path: str  # the zinfjax leaf: blocks/q_lora/a
    layer: int
    in_axes: int  # of the zinfjax leaf read as a LINEAR kernel: the projection's for A, 1 for B
    zshape: tuple[int, ...]  # one layer of the zinfjax leaf

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return hf_shape(Layout.LINEAR, self.zshape, self.in_axes)


def is_peft(src: str) -> bool:
    """Whether ``src`` is a PEFT adapter directory (it holds ``adapter_config.json``)."""
    return os.path.isfile(os.path.join(src, ADAPTER_CONFIG))


def without_lora(config: ModelConfig) -> ModelConfig:
    """``config`` with no adapters: the base model an adapter was trained on, or a merged model."""
    return config.replace(**_LORA_DEFAULTS)


@functools.cache
def adapter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The stacked shape of every adapter leaf of ``config``'s model, by path (``blocks/q_lora/a``); none without."""
    if not config.lora_rank:
        return {}
    model = models.build(config)
    tree = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    flat = traverse_util.flatten_dict(tree)
    return {"/".join(k): tuple(x.shape) for k, x in flat.items() if is_adapter(k)}


def _rules(arch: str) -> dict[str, Rule]:
    """Each LoRA target of ``arch`` whose projection is one HF ``nn.Linear`` (what PEFT adapts), with its rule."""
    rules = {r.paths: r for r in BY_ARCH[arch].rules if r.layout is Layout.LINEAR}
    return {t: rules[(f"blocks/{m}/kernel",)] for t, m in MODULES.get(arch, {}).items()
            if (f"blocks/{m}/kernel",) in rules}


def _module(rule: Rule) -> str:
    """The HF module a rule's weight belongs to, as PEFT's ``target_modules`` names it: ``q_proj``."""
    return rule.hf.removesuffix(".weight").rsplit(".", 1)[-1]


def _entries(config: ModelConfig, body: str) -> list[_Entry]:
    """Every PEFT tensor of ``config``'s adapters, layer by layer, with ``body`` the model's prefix (``model.``)."""
    shapes, rules = adapter_shapes(config), _rules(config.arch)
    out = []
    for i in range(config.n_layers):
        for t in (t for t in TARGETS if t in config.lora_targets):
            module = PREFIX + body + rules[t].hf.removesuffix(".weight").format(i=i)
            leaf = f"blocks/{MODULES[config.arch][t]}{SUFFIX}/"
            out.append(_Entry(f"{module}.lora_A.weight", leaf + "a", i, rules[t].in_axes, shapes[leaf + "a"][1:]))
            out.append(_Entry(f"{module}.lora_B.weight", leaf + "b", i, 1, shapes[leaf + "b"][1:]))
    return out


def check_adapters(where: str, config: ModelConfig) -> None:
    """Refuses a model without adapters, or with adapters PEFT cannot hold (every GPT-2 one)."""
    if not config.lora_rank:
        raise AdapterError(f"{where} holds no LoRA adapters (its model has lora_rank 0): --to peft writes a LoRA "
                           "fine-tune's adapters; --to hf exports this model")
    mapped = _rules(config.arch)
    bad = [t for t in config.lora_targets if t not in mapped]
    if bad:
        raise AdapterError(f"{where}: the {config.arch} adapters on {', '.join(bad)} have no PEFT equivalent (GPT-2's "
                           "c_attn fuses q, k and v, its projections are Conv1D); only llama adapters map onto PEFT. "
                           "--to hf --merge exports the model with the adapters folded in")


def adapter_config(config: ModelConfig) -> dict:
    """The ``adapter_config.json`` of ``config``'s adapters: a PEFT ``LoraConfig`` of plain LoRA.

    ``base_model_name_or_path`` is null: a zinfjax checkpoint does not record the Hugging Face model it was
    converted from, so ``PeftModel.from_pretrained`` is given the base model itself.
    """
    alpha = config.lora_alpha
    rules = _rules(config.arch)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "revision": None,
        "inference_mode": True, "r": config.lora_rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": float(config.lora_dropout),
        "target_modules": [_module(rules[t]) for t in TARGETS if t in config.lora_targets],
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "use_rslora": False, "use_dora": False, "lora_bias": False,
    }


def write_peft(source, dst: str) -> dict:
    """Writes the adapters of the LoRA checkpoint ``source`` (a `ZinfjaxCheckpoint`) as the PEFT directory ``dst``.

    Each adapter layer is read, laid out as PEFT's and written at once (`SafetensorsWriter`); then
    ``adapter_config.json``. Raises `AdapterError` when ``source`` has no adapters PEFT can hold.
    """
    config = source.config
    check_adapters(source.directory, config)
    held = [f for f in (ADAPTER_CONFIG, *ADAPTER_FILES) if os.path.exists(os.path.join(dst, f))]
    if held:
        raise AdapterError(f"{dst} already holds {', '.join(held)}: write to a new or empty directory, or remove "
                           "them first")
    entries = _entries(config, BY_ARCH[config.arch].bodies[0])
    specs = [(e.name, source.adapters[e.path].dtype, e.hf_shape) for e in entries]
    os.makedirs(dst, exist_ok=True)
    with SafetensorsWriter(os.path.join(dst, ADAPTER_FILES[0]), specs) as writer:
        for e in entries:
            writer.write(to_hf(Layout.LINEAR, source.read(e.path, e.layer), e.in_axes))
    _write_json(os.path.join(dst, ADAPTER_CONFIG), adapter_config(config))
    return {"path": os.path.abspath(dst), "step": source.step, "tensors": len(entries),
            "bytes": writer.bytes_written, "dtype": specs[0][1].name, "model": dataclasses.asdict(config)}


class Merged:
    """A LoRA checkpoint (a `ZinfjaxCheckpoint`) read as its base model with the adapters folded in.

    ``read`` gives each adapted kernel as ``W + (alpha / r) A B`` (computed in float64, cast to
    ``W``'s dtype) and every other leaf as it is; ``config`` is the model without adapters.
    """

    def __init__(self, source):
        if not source.config.lora_rank:
            raise AdapterError(f"--merge: {source.directory} holds no LoRA adapters to merge; leave out --merge")
        c = source.config
        self.source, self.config, self.like, self.step = source, without_lora(c), source.like, source.step
        self.directory = source.directory
        self._adapted = {f"blocks/{MODULES[c.arch][t]}/kernel": f"blocks/{MODULES[c.arch][t]}{SUFFIX}/"
                         for t in c.lora_targets}
        self._scale = c.lora_alpha / c.lora_rank

    def read(self, path: str, layer: int | None) -> np.ndarray:
        """One layer of the leaf ``path``, its adapter (if any) folded in."""
        w = self.source.read(path, layer)
        leaf = self._adapted.get(path)
        if leaf is None:
            return w
        a, b = (self.source.read(leaf + n, layer).astype(np.float64) for n in ("a", "b"))
        return (w.astype(np.float64) + self._scale * np.tensordot(a, b, axes=1)).astype(w.dtype)


def import_peft(src: str, dst: str, base: str | None, lr: float) -> dict:
    """Converts the PEFT LoRA adapter ``src`` into the zinfjax checkpoint ``dst/0``: its adapter leaves (fp32),
    no optimizer state, and the `ModelConfig` of ``base`` with the adapter's rank, alpha and targets.

    ``base`` is the zinfjax checkpoint of the adapter's base model (``zinfjax convert HF_BASE runs/base``);
    the new checkpoint names it by path and digest (`base_ref`), so training resumes on it.
    """
    if base is None:
        raise AdapterError(f"{src} is a PEFT LoRA adapter, which holds no base weights: give --base, the zinfjax "
                           "checkpoint of its base model (zinfjax convert HF_BASE_DIR runs/base makes one)")
    settings = read_adapter_config(src)
    base_dir, base_model = checkpoint_model(base)
    if base_model.lora_rank or not _rules(base_model.arch):
        what = "holds LoRA adapters itself" if base_model.lora_rank else f"is a {base_model.arch} model"
        raise AdapterError(f"--base {base_dir} {what}: give the zinfjax checkpoint of a llama base model (PEFT "
                           "adapters map onto llama's projections only)")
    with StateDictFile(_adapter_file(src)) as files:
        model = _adapted_model(src, files.names(), base_model, settings)
        body = "model." if any(n.startswith(PREFIX + "model.") for n in files.names()) else ""
        entries = _entries(model, body)
        _check_tensors(src, files, entries)
        return _write_adapters(files, entries, model, dst, base_dir, lr)


def read_adapter_config(src: str) -> dict:
    """``src``'s adapter_config.json, checked to be plain LoRA as zinfjax computes it (each other setting named)."""
    path = os.path.join(src, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path} cannot be read as JSON: {e}") from e
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r}; zinfjax converts LoRA adapters only")
    variants = [f"{k}={cfg[k]!r}" for k in VARIANTS if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        variants.append(f"bias={cfg['bias']!r}")
    if variants:
        raise AdapterError(f"{path} sets {', '.join(variants)}: zinfjax computes plain LoRA, (lora_alpha / r) B A x on "
                           "every layer with no bias, rsLoRA, DoRA or modules_to_save")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), int | float) or cfg[key] <= 0:
            raise AdapterError(f"{path}: {key}={cfg.get(key)!r} must be a positive number")
    return cfg


def _adapted_model(src: str, names: list[str], base: ModelConfig, cfg: dict) -> ModelConfig:
    """``base`` with the adapters of ``src``: the targets are the modules its tensors adapt."""
    by_module = {_module(rule): t for t, rule in _rules(base.arch).items()}
    listed = cfg.get("target_modules")
    if isinstance(listed, list):  # a string (a regex, "all-linear") is checked by the tensors alone
        bad = [m for m in listed if m.rsplit(".", 1)[-1] not in by_module]
        if bad:
            raise AdapterError(f"{src}: target_modules {', '.join(bad)} are modules zinfjax's {base.arch} LoRA does "
                               f"not adapt; it adapts {', '.join(by_module)}")
    modules = {n.split(".")[-3] for n in names if n.count(".") >= 3}  # <module>.lora_A.weight
    found = {by_module[m] for m in modules if m in by_module}
    if not found:
        raise AdapterError(f"{src} holds no LoRA tensors of {', '.join(by_module)}: nothing zinfjax can adapt")
    targets = tuple(t for t in TARGETS if t in found)
    return base.replace(lora_rank=int(cfg["r"]), lora_alpha=float(cfg["lora_alpha"]), lora_targets=targets,
                        lora_dropout=float(cfg.get("lora_dropout") or 0.0))


def _adapter_file(src: str) -> str:
    for name in ADAPTER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            return os.path.join(src, name)
    raise AdapterError(f"{src} has an {ADAPTER_CONFIG} but none of {', '.join(ADAPTER_FILES)}: the adapter's "
                       "weights are missing")


def _check_tensors(src: str, files: StateDictFile, entries: list[_Entry]) -> None:
    """Every tensor the adapter's model implies, none other, each of the shape implied (the first fault named)."""
    names, want = set(files.names()), {e.name: e for e in entries}
    missing = [e.name for e in entries if e.name not in names]
    if missing:
        raise MissingTensorError(f"{src} lacks {len(missing)} LoRA tensors, e.g. {', '.join(missing[:3])}")
    unexpected = sorted(names - set(want))
    if unexpected:
        raise UnexpectedTensorError(f"{src} holds tensors zinfjax does not map: {', '.join(unexpected[:3])}"
                                    + (", ..." if len(unexpected) > 3 else ""))
    for e in entries:
        if files.shape(e.name) != e.hf_shape:
            raise ShapeMismatchError(f"{src}: tensor {e.name} has shape {files.shape(e.name)}, the base model and r "
                                     f"imply {e.hf_shape}")


def _write_adapters(files: StateDictFile, entries: list[_Entry], model: ModelConfig, dst: str, base: str,
                    lr: float) -> dict:
    """Writes the adapter leaves of ``entries`` as the checkpoint ``dst/0``, naming ``base``."""
    f32 = {e.path: jax.ShapeDtypeStruct((model.n_layers, *e.zshape), np.float32) for e in entries}
    params = expected_leaves(traverse_util.unflatten_dict(f32, sep="/"), optax.set_to_zero())["params"]
    final = fmt.step_dir(os.path.abspath(dst), 0)
    if os.path.exists(final):
        raise AdapterError(f"{final} exists already: convert into another directory, or remove it first")
    config = Config(precision="fp32", optimizer_name="adamw", lr=lr, model=base, lora_rank=model.lora_rank,
                    lora_alpha=model.lora_alpha, lora_targets=",".join(model.lora_targets),
                    lora_dropout=model.lora_dropout)
    writer = CheckpointWriter(dst, 0, {"params": params, "opt_state": {}}, config=config, model=model,
                              base=base_ref(base))
    try:
        for e in entries:
            array = to_zinfjax(Layout.LINEAR, files.get(e.name), e.zshape).astype(np.float32)
            writer.write("params", leaf_name(e.path), e.layer, array)
        path = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"path": path, "step": 0, "tensors": len(entries), "bytes": writer.bytes_written, "dtype": "float32",
            "model": dataclasses.asdict(model), "base": base, "lr": lr}
