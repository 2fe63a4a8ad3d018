"""``zinfjax convert``: Hugging Face, DeepSpeed, torch ``state_dict`` and zinfjax checkpoints, streamed.

Every conversion holds one tensor at a time: the source is checked whole from its headers first
(architecture, names, shapes), then each tensor is read, laid out and written at once, either as
its layer's chunk of a zinfjax checkpoint (`CheckpointWriter`) or as the next tensor of a
safetensors file whose header was written first (`zinfjax_interop.hf.write_hf`).

| source (``--from``, found by itself) | what it is |
|---|---|
| ``hf`` | a directory with config.json and model.safetensors / pytorch_model.bin (single or sharded) |
| ``deepspeed`` | a DeepSpeed save dir (``latest``, ``global_stepN/*_optim_states.pt``), see `.deepspeed` |
| ``zinfjax`` | a zinfjax checkpoint (``zinfjax.json``), or a save_dir of them (the newest is read) |
| ``torch`` | a ``torch.save``'d state_dict (.pt/.pth/.bin) or a .safetensors file, with ``model`` and a mapping |
| ``peft`` | a PEFT LoRA adapter (``adapter_config.json``), with ``base``: the zinfjax checkpoint of its base |

A zinfjax checkpoint with LoRA adapters goes ``to="peft"`` (a PEFT adapter directory) or, with
``merge=True``, ``to="hf"`` with the adapters folded into the weights (`zinfjax_interop.peft`).

Example:
    >>> import numpy as np, tempfile
    >>> from zinfjax_interop.hf import save_hf, zinfjax_shapes
    >>> config, rng = ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)     # a random GPT-2, saved as
    >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
    >>> gpt2_dir = tempfile.mkdtemp(); save_hf(params, config, gpt2_dir)              # Hugging Face saves one
    >>> runs = tempfile.mkdtemp()
    >>> convert(gpt2_dir, f"{runs}/gpt2")                      # runs/gpt2/0: params + fresh adamw state
    {'source': '...', 'format': 'hf', 'to': 'zinfjax', 'path': '.../gpt2/0', 'step': 0, 'tensors': ..., ...}
    >>> convert(f"{runs}/gpt2", f"{runs}/gpt2-again", to="hf")["tensors"]          # config.json + model.safetensors
    52
    >>> sorted(os.listdir(f"{runs}/gpt2-again"))
    ['config.json', 'model.safetensors']

A zinfjax LoRA checkpoint goes ``to="peft"`` the same way: ``convert("runs/lora", "out/adapter", to="peft")``
writes adapter_config.json and adapter_model.safetensors (`zinfjax_interop.peft` has the example).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil

import jax
import numpy as np
from flax import traverse_util

from zinfjax._util.byte_sizes import format_bytes, parse_bytes
from zinfjax._util.mapping_files import read_mapping
from zinfjax.checkpoint import CheckpointWriter, expected_leaves, read_meta
from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.base import check_base
from zinfjax.checkpoint.model import checkpoint_model
from zinfjax.checkpoint.model import resolve_model as zinfjax_model
from zinfjax.checkpoint.reader import LeafReader
from zinfjax.checkpoint.tokenizer import tokenizer_dir
from zinfjax.config import Config
from zinfjax.data.tokenizers import SUBDIR, copy_tokenizer
from zinfjax.models import ModelConfig
from zinfjax.models.configs import NAMED
from zinfjax.store.disk import free_bytes, is_disk_full
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax_interop.errors import (
    AdapterError,
    CheckpointFilesError,
    ConversionError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnknownArchitectureError,
)
from zinfjax_interop.files import (
    SAFETENSORS,
    SAFETENSORS_INDEX,
    TORCH_BIN,
    TORCH_BIN_INDEX,
    StateDictFile,
)
from zinfjax_interop.hf import CONFIG, HFCheckpoint, Tensor, hf_specs, write_hf, zinfjax_shapes
from zinfjax_interop.hf_config import from_hf_config
from zinfjax_interop.mapping import load_mapping
from zinfjax_interop.peft import Merged, adapter_shapes, import_peft, is_peft, without_lora, write_peft
from zinfjax_interop.tables import BY_ARCH

FORMATS = ("hf", "deepspeed", "zinfjax", "torch", "peft")
TARGETS = ("zinfjax", "hf", "peft")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


class SourceError(ConversionError):
    """A source that is no checkpoint zinfjax reads, or options that do not fit it."""


def convert(src: str, dst: str, to: str = "zinfjax", *, source_format: str | None = None,
            model: ModelConfig | str | None = None, mapping: str | None = None, lr: float | None = None,
            dtype: str | None = None, max_shard_size: int | str = "5GB", progress: bool = False,
            base: str | None = None, merge: bool = False) -> dict:
    """Converts the checkpoint ``src`` into a zinfjax checkpoint (``to="zinfjax"``), an HF directory (``"hf"``) or
    a PEFT adapter directory (``"peft"``, from a zinfjax checkpoint with LoRA adapters).

    Args:
        src: a checkpoint of any of `FORMATS`; ``source_format`` names it when the guess is not wanted.
        dst: ``to="zinfjax"``: a save_dir, the checkpoint is ``dst/<step>`` (step 0 for HF and torch
            sources, DeepSpeed's global step); ``to="hf"``: the HF model directory.
        model: the model of a torch state_dict (needed) or a DeepSpeed checkpoint (default: the
            config.json beside it): a named size (``gpt2-tiny``), a ModelConfig JSON/YAML file,
            or an HF config.json or its directory.
        mapping: for a torch state_dict, the name-mapping file (`zinfjax_interop.mapping`); without it the
            names must be Hugging Face's for the model's architecture.
        lr: the learning rate recorded with a fresh adamw state (default 3e-4); for DeepSpeed, an
            override of the optimizer's.
        dtype: ``to="hf"`` only: ``fp32``, ``bf16`` or ``fp16`` (default: the source's).
        max_shard_size: ``to="hf"`` only: past this size (``"5GB"``, as transformers) the tensors go
            into shards with a ``model.safetensors.index.json``.
        progress: show a progress bar (bytes, tensors).
        base: for a PEFT adapter (needed), the zinfjax checkpoint of its base model.
        merge: ``to="hf"`` from a checkpoint with LoRA adapters: fold them into the weights (needed there).

    Returns:
        A summary: ``source``, ``format``, ``to``, ``path``, ``step``, ``tensors``, ``bytes`` (written),
        ``dtype``, ``model`` (the `ModelConfig` as a dict).
    """
    if to not in TARGETS:
        raise SourceError(f"--to {to!r}: choose one of {', '.join(TARGETS)}")
    if dtype is not None and (to != "hf" or dtype not in DTYPES):
        raise SourceError(f"--dtype {dtype}: only --to hf takes a dtype, one of {', '.join(DTYPES)}" if to == "hf"
                          else "--dtype applies to --to hf; a zinfjax checkpoint holds fp32 master weights")
    kind = source_format or detect_format(src, to)
    if kind not in FORMATS:
        raise SourceError(f"--from {kind!r}: choose one of {', '.join(FORMATS)}")
    if mapping is not None and kind != "torch":
        raise SourceError(f"--mapping names the tensors of a torch state_dict; {src} is a {kind} checkpoint")
    if model is not None and kind in ("hf", "zinfjax", "peft"):
        raise SourceError(f"{src} is a {kind} checkpoint, which records its own model: leave out --model")
    _check_lora_options(src, kind, to, base, merge)
    model_config = resolve_model(model) if model is not None else None
    hf = HFTarget(DTYPES[dtype] if dtype else None, parse_bytes(max_shard_size), merge)
    try:
        out = _convert(src, dst, to, kind, model_config, mapping, lr, hf, progress, base)
        out["tokenizer"] = _carry_tokenizer(src, dst, to)
    except OSError as e:
        raise _write_error(dst, e) from e
    return {"source": os.path.abspath(src), "format": kind, "to": to, **out}


def _check_lora_options(src: str, kind: str, to: str, base: str | None, merge: bool) -> None:
    """The options of LoRA conversions fit the source and the target (each misfit named)."""
    if merge and to != "hf":
        raise SourceError(f"--merge applies to --to hf (it folds LoRA adapters into the weights written); --to is {to}")
    if merge and kind != "zinfjax":
        raise SourceError(f"--merge folds a zinfjax checkpoint's LoRA adapters into the weights; {src} is a {kind} "
                          "checkpoint, which holds none: leave out --merge")
    if base is not None and kind != "peft":
        raise SourceError(f"--base names the base model of a PEFT adapter; {src} is a {kind} checkpoint, which "
                          "needs none: leave out --base")
    if kind == "peft" and to != "zinfjax":
        raise SourceError(f"{src} is a PEFT adapter: it converts --to zinfjax (with --base); convert that checkpoint "
                          "--to hf --merge for a merged model")
    if to == "peft" and kind != "zinfjax":
        raise AdapterError(f"--to peft writes the LoRA adapters of a zinfjax checkpoint; {src} is a {kind} "
                           "checkpoint, which holds no LoRA adapters")


def _carry_tokenizer(src: str, dst: str, to: str) -> str | None:
    """The source's tokenizer files (`zinfjax.checkpoint.tokenizer.tokenizer_dir`: beside it, or beside the base an
    adapter run names), carried along: into ``<dst>/tokenizer`` beside a zinfjax save_dir, or into an HF
    directory's own; None when the source has none."""
    origin = src if os.path.isdir(src) else os.path.dirname(src)
    found = tokenizer_dir(origin)
    return copy_tokenizer(found, os.path.join(dst, SUBDIR) if to == "zinfjax" else dst) if found else None


def _convert(src: str, dst: str, to: str, kind: str, model_config: ModelConfig | None, mapping: str | None,
             lr: float | None, hf: HFTarget, progress: bool, base: str | None) -> dict:
    if kind == "peft":
        out = import_peft(src, dst, base, lr if lr is not None else Config().lr)
    elif kind == "deepspeed":
        out = _from_deepspeed(src, dst, to, model_config, lr, hf, progress)
    elif to == "zinfjax":
        if kind == "zinfjax":
            raise SourceError(f"{src} is a zinfjax checkpoint already; --to hf writes Hugging Face's layout")
        with open_source(src, kind, model_config, mapping) as source:
            out = write_zinfjax(source, dst, lr if lr is not None else Config().lr, progress)
    else:
        with open_source(src, kind, model_config, mapping) as source:
            out = write_peft(source, dst) if to == "peft" else _write_hf(source, dst, hf, progress)
    return out


def _write_error(dst: str, e: OSError) -> ConversionError:
    """An OSError while writing ``dst`` as the user's problem: a full disk or a path that cannot be written."""
    if is_disk_full(e):
        return ConversionError(f"the disk is full: no space left on the filesystem of {dst} ({e.strerror or e}); "
                               "nothing was written there. Free some space or convert to another directory")
    return ConversionError(f"cannot write {dst}: {e.strerror or e}; nothing was written there. Choose a writable "
                           "directory")


def check_space(dst: str, needed: int) -> None:
    """Refuses before any write when the filesystem of ``dst`` has less than ``needed`` bytes free."""
    existing = os.path.abspath(dst)
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    free = free_bytes(existing)
    if needed > free:
        raise ConversionError(f"the disk is full for this conversion: {dst} needs {format_bytes(needed)} and its "
                              f"filesystem has {format_bytes(free)} free; nothing was written. Free some space or "
                              "convert to another directory")


def detect_format(src: str, to: str = "zinfjax") -> str:
    """The format of ``src``, from the files it holds (see the module's table).

    A Hugging Face Trainer's checkpoint directory holds both an HF model and a DeepSpeed checkpoint:
    DeepSpeed's (with its optimizer state) is read for ``to="zinfjax"``, the HF model for ``"hf"``.

    Example:
        >>> import numpy as np, tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> detect_format(write_params(tempfile.mkdtemp(), {"w": np.ones(4, np.float32)}))
        'zinfjax'
        >>> detect_format(tempfile.mkdtemp())
        Traceback (most recent call last):
        zinfjax_interop.convert.SourceError: ... is no checkpoint zinfjax recognises: expected a Hugging Face model ...
    """
    src = _strip_scheme(src)
    if os.path.isfile(src):
        if src.endswith(STATE_DICT_SUFFIXES):
            return "torch"
        raise SourceError(f"{src} is a file but not a state_dict zinfjax reads ({', '.join(STATE_DICT_SUFFIXES)})")
    if not os.path.isdir(src):
        raise SourceError(f"{src} does not exist")
    if os.path.isfile(os.path.join(src, fmt.META)) or fmt.complete_steps(src):
        return "zinfjax"
    if is_peft(src):
        return "peft"
    weights = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)
    hf = os.path.isfile(os.path.join(src, CONFIG)) and any(os.path.isfile(os.path.join(src, w)) for w in weights)
    deepspeed = _is_deepspeed(src)
    if hf and deepspeed:
        return "deepspeed" if to == "zinfjax" else "hf"
    if hf or deepspeed:
        return "hf" if hf else "deepspeed"
    raise SourceError(
        f"{src} is no checkpoint zinfjax recognises: expected a Hugging Face model directory (config.json and "
        f"{SAFETENSORS} or {TORCH_BIN}), a DeepSpeed save dir (latest, global_stepN/*_optim_states.pt), a zinfjax "
        f"checkpoint (zinfjax.json), a PEFT adapter (adapter_config.json) or a torch state_dict file "
        f"({', '.join(STATE_DICT_SUFFIXES)}); "
        "--from names the format"
    )


def _is_deepspeed(src: str) -> bool:
    def states(d):
        return bool(glob.glob(os.path.join(d, "*_optim_states.pt")) or glob.glob(os.path.join(d, "*_model_states.pt")))

    return (os.path.isfile(os.path.join(src, "latest")) or states(src)
            or any(states(d) for d in glob.glob(os.path.join(src, "global_step*"))))


def _strip_scheme(src: str) -> str:
    return src[len("hf://"):] if src.startswith("hf://") else src


def resolve_model(spec: ModelConfig | str) -> ModelConfig:
    """A `ModelConfig` from an HF config.json (or its directory), or a zinfjax model spec (`zinfjax_model`).

    Example:
        >>> resolve_model("gpt2-tiny").n_layers
        4
    """
    if isinstance(spec, ModelConfig):
        return spec
    path = os.path.join(spec, CONFIG) if os.path.isdir(spec) else spec
    values = read_mapping(path, "--model file", SourceError) if os.path.isfile(path) else {}
    model = from_hf_config(values) if "model_type" in values else zinfjax_model(spec)
    if model.arch not in BY_ARCH:
        raise UnknownArchitectureError(f"--model {spec} has arch {model.arch!r}, which zinfjax cannot convert; "
                                       f"supported: {', '.join(BY_ARCH)}")
    return model


def open_source(src: str, kind: str, model: ModelConfig | None = None, mapping: str | None = None):
    """The checkpoint ``src`` of format ``kind`` (not DeepSpeed), checked whole, as a reader of zinfjax leaves.

    The reader has ``config`` (the `ModelConfig`), ``like`` (every leaf's stacked shape and dtype),
    ``step``, ``tensors()`` (a stream of `Tensor`) and ``read(path, layer)``.
    """
    src = _strip_scheme(src)
    if kind == "hf":
        ckpt = HFCheckpoint(src)
        ckpt.step = 0
        return ckpt
    if kind == "zinfjax":
        return ZinfjaxCheckpoint(src)
    if model is None:
        raise SourceError(f"{src} is a torch state_dict, which records no model: give --model (a named size such as "
                          "gpt2-tiny, a ModelConfig JSON or an HF config.json)")
    if model.arch not in BY_ARCH:
        raise UnknownArchitectureError(f"zinfjax cannot convert arch {model.arch!r}; supported: {', '.join(BY_ARCH)}")
    table = load_mapping(mapping, model) if mapping is not None else BY_ARCH[model.arch]
    if not os.path.isfile(src):
        raise CheckpointFilesError(f"{src} is not a file: a torch state_dict is one .pt/.pth/.bin file")
    ckpt = HFCheckpoint.from_files(src, model, table, StateDictFile(src))
    ckpt.step = 0
    return ckpt


class ZinfjaxCheckpoint:
    """A zinfjax checkpoint's parameters, read one layer of one leaf at a time (`LeafReader`).

    Every chunk's crc32c is checked as it is read. ``path`` is a checkpoint or a save_dir (its newest).
    ``config`` is the model it records; ``like`` every leaf of that model without adapters (path ->
    stacked shape and dtype) and ``adapters`` its LoRA adapter leaves (none without). A LoRA checkpoint
    that holds its adapters alone names its frozen base (``meta["base"]``): the base's digest is
    checked (`check_base`) and the other leaves are read from there.

    Example:
        >>> import numpy as np, tempfile
        >>> from zinfjax_interop.hf import save_hf, zinfjax_shapes
        >>> config, rng = ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)     # a random GPT-2, saved as
        >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
        >>> gpt2_dir = tempfile.mkdtemp(); save_hf(params, config, gpt2_dir)              # Hugging Face saves one
        >>> ckpt_path = convert(gpt2_dir, tempfile.mkdtemp())["path"]
        >>> with ZinfjaxCheckpoint(ckpt_path) as ckpt:
        ...     q0 = ckpt.read("blocks/q/kernel", 0)
        >>> q0.shape, bool((q0 == params["blocks/q/kernel"][0]).all())
        ((64, 8, 8), True)
    """

    def __init__(self, path: str):
        self.directory, self.config = checkpoint_model(path)
        meta = read_meta(self.directory)
        self.step = int(meta["step"])
        if self.config.arch not in BY_ARCH:
            raise UnknownArchitectureError(f"{self.directory} holds a {self.config.arch!r} model, which zinfjax cannot "
                                           f"convert; supported: {', '.join(BY_ARCH)}")
        shapes, adapters = zinfjax_shapes(without_lora(self.config)), adapter_shapes(self.config)
        self.base = check_base(meta["base"], self.directory) if meta.get("base") else None
        own = meta["items"]["params"]
        _check_leaves(self._where(self.directory), own, adapters if self.base else {**shapes, **adapters})
        base_items = read_meta(self.base)["items"] if self.base else meta["items"]
        if self.base:
            _check_leaves(f"the base {self._where(self.base)}", base_items["params"], shapes)
        self.like = {p: jax.ShapeDtypeStruct(s, np.dtype(base_items["params"][_name(p)]["dtype"]))
                     for p, s in shapes.items()}
        self.adapters = {p: jax.ShapeDtypeStruct(s, np.dtype(own[_name(p)]["dtype"])) for p, s in adapters.items()}
        self._reader = LeafReader(self.directory, meta["items"])
        self._base_reader = LeafReader(self.base, base_items) if self.base else self._reader

    def _where(self, directory: str) -> str:
        return f"{directory} ({self.config.arch}, {self.config.n_layers} layers)"

    @property
    def names(self) -> list[str]:
        return [_name(p) for p in self.like]

    def tensors(self):
        for p, s in self.like.items():
            for layer in range(s.shape[0]) if p.startswith("blocks/") else [None]:
                yield Tensor(p, layer, self.read(p, layer))

    def read(self, path: str, layer: int | None) -> np.ndarray:
        """One layer (``layer`` None outside blocks) of the params leaf ``path`` (``"blocks/q/kernel"``)."""
        reader = self._reader if path in self.adapters else self._base_reader
        return reader.read("params", _name(path), layer)

    def close(self) -> None:
        self._reader.close()
        self._base_reader.close()

    def __enter__(self) -> ZinfjaxCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_leaves(where: str, saved: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    """The params leaves ``saved`` are exactly ``shapes``' paths, each of its shape (the first fault named)."""
    missing = [_name(p) for p in shapes if _name(p) not in saved]
    if missing:
        raise MissingTensorError(f"{where} lacks the params leaves {', '.join(missing)}")
    extra = [n for n in saved if n not in {_name(p) for p in shapes}]
    if extra:
        raise UnexpectedTensorError(f"{where} holds params leaves the model does not have: {', '.join(extra)}")
    for p, shape in shapes.items():
        if tuple(saved[_name(p)]["shape"]) != shape:
            raise ShapeMismatchError(f"{where}: leaf {_name(p)} has shape {tuple(saved[_name(p)]['shape'])}, "
                                     f"the model implies {shape}")


def _name(path: str) -> str:
    """A params leaf's name in a checkpoint: ``blocks/q/kernel`` -> ``blocks.q.kernel``."""
    return path.replace("/", ".")


def write_zinfjax(source, dst: str, lr: float, progress: bool = False) -> dict:
    """Writes ``source``'s parameters (fp32) and a fresh adamw state as the zinfjax checkpoint ``dst/<step>``.

    Each source tensor goes straight into its layer's chunk; then each optimizer leaf's layer is
    written as optax's adamw initialises it (zeros, count 0). The recorded `Config` (fp32, adamw,
    ``lr``) and `ModelConfig` let ``zinfjax.wrap(..., restore=dst)`` train from it.
    """
    model = source.config
    config = Config(precision="fp32", optimizer_name="adamw", lr=lr, model=named_size(model) or Config().model)
    f32 = {p: jax.ShapeDtypeStruct(s, np.float32) for p, s in zinfjax_shapes(model).items()}
    leaves = expected_leaves(traverse_util.unflatten_dict(f32, sep="/"), make_optimizer(config))
    final = fmt.step_dir(os.path.abspath(dst), source.step)
    if os.path.exists(final):
        raise SourceError(f"{final} exists already: convert into another directory, or remove it first")
    total = sum(_nbytes(leaf.meta) for item in leaves.values() for leaf in item.values())
    check_space(dst, total)
    writer = CheckpointWriter(dst, source.step, leaves, config=config, model=model)
    bar = _Bar(total, _chunks(leaves["params"]), progress)
    try:
        for t in source.tensors():
            array = t.array.astype(np.float32, copy=False)
            writer.write("params", _name(t.path), t.layer, array)
            bar.update(array.nbytes)
        bar.phase("adamw state", _chunks(leaves["opt_state"]))
        for name, leaf in leaves["opt_state"].items():  # adamw's init: zero moments, count 0
            shape, dtype = leaf.meta["shape"], np.dtype(leaf.meta["dtype"])
            for layer in range(shape[0]) if leaf.stacked else [None]:
                zeros = np.zeros(shape[1:] if layer is not None else shape, dtype)
                writer.write("opt_state", name, layer, zeros)
                bar.update(zeros.nbytes)
        path = writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return {"path": path, "step": source.step, "tensors": len(source.names), "bytes": writer.bytes_written,
            "dtype": "float32", "model": dataclasses.asdict(model), "lr": lr}


@dataclasses.dataclass(frozen=True)
class HFTarget:
    """How ``--to hf`` writes: the tensors' dtype (None: the source's), the shard size, and whether LoRA adapters
    are folded into the weights."""

    dtype: str | None
    max_shard_bytes: int
    merge: bool = False


def _write_hf(source, dst: str, hf: HFTarget, progress: bool) -> dict:
    held = [f for f in (CONFIG, SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)
            if os.path.isfile(os.path.join(dst, f))] + sorted(glob.glob(os.path.join(dst, "model-*-of-*.safetensors")))
    if held:  # a model's files, even a lone config.json: writing would replace them
        names = ", ".join(os.path.basename(f) for f in held[:3]) + (", ..." if len(held) > 3 else "")
        raise SourceError(f"{dst} already holds a model's files ({names}): write to a new or empty directory, or "
                          "remove them first")
    source = _without_adapters(source, hf.merge)
    dtypes = {p: s.dtype for p, s in source.like.items()}
    specs = hf_specs(source.config, dtypes, hf.dtype)
    total = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize for _, dt, shape in specs)
    check_space(dst, total)
    bar = _Bar(total, len(specs), progress)
    try:
        out = write_hf(source.read, dtypes, source.config, dst, hf.dtype, on_tensor=bar.update,
                       max_shard_bytes=hf.max_shard_bytes)
    finally:
        bar.close()
    return {"path": os.path.abspath(dst), "step": source.step, **out, "model": dataclasses.asdict(source.config)}


def _without_adapters(source, merge: bool):
    """``source`` with its LoRA adapters folded in (`Merged`) when ``merge``; a LoRA source is refused without."""
    if merge:
        return Merged(source)
    c = source.config
    if c.lora_rank:
        raise AdapterError(f"{source.directory} holds LoRA adapters (rank {c.lora_rank} on "
                           f"{', '.join(c.lora_targets)}): add --merge to fold them into the weights, or write them "
                           "as a PEFT adapter with --to peft")
    return source


def _from_deepspeed(src: str, dst: str, to: str, model: ModelConfig | None, lr: float | None, hf: HFTarget,
                    progress: bool) -> dict:
    from zinfjax_interop.deepspeed import convert_deepspeed

    kwargs = {"progress": progress, **({"lr": lr} if lr is not None else {})}
    if to == "zinfjax":
        out = convert_deepspeed(_strip_scheme(src), dst, model, **kwargs)
        return {**out, "model": read_meta(out["path"]).get("model")}
    staging = os.path.join(dst, ".deepspeed-staging")  # the fp32 weights go through a zinfjax checkpoint
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staged = convert_deepspeed(_strip_scheme(src), staging, model, **kwargs)
        with ZinfjaxCheckpoint(staged["path"]) as source:
            return _write_hf(source, dst, hf, progress)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def named_size(model: ModelConfig) -> str | None:
    """The name of ``model`` among the named sizes, if it is one."""
    return next((name for name, m in NAMED.items() if m == model), None)


def _nbytes(meta: dict) -> int:
    return int(np.prod(meta["shape"], dtype=np.int64)) * np.dtype(meta["dtype"]).itemsize


def _chunks(leaves: dict) -> int:
    """The chunks a checkpoint's leaves are written as: one per layer of a block leaf, one per other leaf."""
    return sum(leaf.meta["shape"][0] if leaf.stacked else 1 for leaf in leaves.values())


class _Bar:
    """A tqdm bar of the bytes written, with the tensors (or chunks) of the current phase written so far."""

    def __init__(self, total_bytes: int, tensors: int, show: bool):
        from tqdm import tqdm

        self.tensors, self.done = tensors, 0
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="params",
                        disable=not show, dynamic_ncols=True)

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.bar.update(nbytes)
        self.bar.set_postfix_str(f"{self.done}/{self.tensors} tensors", refresh=False)

    def phase(self, name: str, tensors: int) -> None:
        self.tensors, self.done = tensors, 0
        self.bar.set_description_str(name, refresh=False)

    def close(self) -> None:
        self.bar.close()
