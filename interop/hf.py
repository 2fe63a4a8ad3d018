"""Hugging Face checkpoints (GPT-2, Llama, BERT) to zinfjax's layered params, and back.

`HFCheckpoint` checks a checkpoint whole (config, names, shapes) before it reads anything,
then yields its tensors one at a time in zinfjax's layout, so a streaming writer can put
each one straight into its layer's chunk. `load_hf` assembles them into the stacked params
pytree; `save_hf` writes params back as a directory that ``transformers`` loads. The
tensor names live in `zinfjax_interop.tables`, the config keys in `zinfjax_interop.hf_config`.

Example:
    >>> import tempfile
    >>> config, rng = models.ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)   # a random GPT-2, saved
    >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
    >>> gpt2_dir = tempfile.mkdtemp()                      # as Hugging Face saves one
    >>> save_hf(params, config, gpt2_dir)
    >>> sorted(os.listdir(gpt2_dir))                        # transformers.AutoModelForCausalLM loads it
    ['config.json', 'model.safetensors']
    >>> config, loaded = load_hf(gpt2_dir)                  # loaded["blocks"] leaves are (L, ...)
    >>> q = loaded["blocks"]["q"]["kernel"]
    >>> q.shape, bool((q == params["blocks/q/kernel"]).all())   # bit for bit
    ((4, 64, 8, 8), True)
    >>> logits = jax.jit(models.build(config).apply)({"params": loaded}, jnp.zeros((1, 8), jnp.int32))
    >>> logits.shape
    (1, 8, 256)
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from zinfjax import models
from zinfjax._util.mapping_files import read_mapping
from zinfjax.models import ModelConfig
from zinfjax_interop.errors import (
    CheckpointFilesError,
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
    SafetensorsWriter,
    TensorFiles,
)
from zinfjax_interop.hf_config import from_hf_config, to_hf_config
from zinfjax_interop.tables import BY_ARCH, FUSE_AXIS, TABLES, ArchTable, Rule, hf_shape, to_hf, to_zinfjax

CONFIG = "config.json"


class Tensor(NamedTuple):
    """One zinfjax leaf of one layer: ``path`` like ``"blocks/q/kernel"``, ``layer`` None outside blocks."""

    path: str
    layer: int | None
    array: np.ndarray


class _Entry(NamedTuple):
    rule: Rule
    layer: int | None


class HFCheckpoint:
    """A Hugging Face checkpoint directory, checked whole when opened.

    Raises `UnknownArchitectureError`, `UnsupportedConfigError`, `MissingTensorError`,
    `UnexpectedTensorError` or `ShapeMismatchError` (each names the key or tensor) before
    any tensor is read.

    Example (a tensor at a time, into stores of the stacked shapes):
        >>> import tempfile
        >>> config, rng = models.ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)   # a random GPT-2, saved
        >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
        >>> gpt2_dir = tempfile.mkdtemp()                      # as Hugging Face saves one
        >>> save_hf(params, config, gpt2_dir)
        >>> from zinfjax.store import open_store
        >>> with HFCheckpoint(gpt2_dir) as ckpt:               # the blocks' leaves, a layer at a time
        ...     stores = {path: open_store("host", {"x": like}) for path, like in ckpt.like.items()
        ...               if path.startswith("blocks/")}
        ...     for path, layer, array in ckpt.tensors():
        ...         if path in stores:
        ...             _ = stores[path].write(layer, {"x": array})
        >>> stores["blocks/q/kernel"].read(3).result()["x"].shape
        (64, 8, 8)
    """

    def __init__(self, directory: str):
        config = from_hf_config(_read_json(os.path.join(directory, CONFIG)))
        self._open(directory, config, BY_ARCH[config.arch], TensorFiles.open(directory))

    @classmethod
    def from_files(cls, name: str, config: ModelConfig, table: ArchTable, files: TensorFiles) -> HFCheckpoint:
        """Tensors named by ``table`` in ``files``, for a model given apart from them, checked whole as HF's are.

        Example (a torch state_dict by Hugging Face's GPT-2 names):
            >>> import tempfile
            >>> config, rng = models.ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)   # a random GPT-2, saved
            >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
            >>> gpt2_dir = tempfile.mkdtemp()                      # as Hugging Face saves one
            >>> save_hf(params, config, gpt2_dir)
            >>> import torch
            >>> from zinfjax_interop.files import StateDictFile
            >>> from zinfjax_interop.tables import GPT2
            >>> with TensorFiles.open(gpt2_dir) as hf:
            ...     torch.save({n: torch.from_numpy(hf.get(n)) for n in hf.names()}, f"{gpt2_dir}/model.pt")
            >>> files = StateDictFile(f"{gpt2_dir}/model.pt")
            >>> ckpt = HFCheckpoint.from_files("model.pt", ModelConfig.named("gpt2-tiny"), GPT2, files)
            >>> ckpt.read("blocks/q/kernel", 3).shape
            (64, 8, 8)
            >>> ckpt.close()
        """
        self = cls.__new__(cls)
        self._open(name, config, table, files)
        return self

    def _open(self, directory: str, config: ModelConfig, table: ArchTable, files: TensorFiles) -> None:
        self.directory, self.config, self.table, self._files = directory, config, table, files
        self._cached: tuple[str, dict[str, np.ndarray]] | None = None
        try:
            self._plan = self._check()
        except BaseException:
            self._files.close()
            raise
        self._entries = dict(self._plan)
        self._holder = {(p, e.layer): name for name, e in self._plan for p in e.rule.paths}

    @property
    def like(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Every zinfjax leaf path with its stacked shape and the checkpoint's dtype."""
        dtypes = {p: self._files.dtype(name) for name, e in self._plan for p in e.rule.paths}
        return {p: jax.ShapeDtypeStruct(s, dtypes[p]) for p, s in zinfjax_shapes(self.config).items()}

    @property
    def names(self) -> list[str]:
        """The checkpoint's tensors that zinfjax keeps, in the order `tensors` reads them."""
        return [name for name, _ in self._plan]

    def tensors(self) -> Iterator[Tensor]:
        """Reads the checkpoint one HF tensor at a time, in file order; a fused tensor yields its parts."""
        for name, entry in self._plan:
            yield from self._parts(name, entry)

    def read(self, path: str, layer: int | None) -> np.ndarray:
        """One zinfjax leaf of one layer (``layer`` None outside blocks), in zinfjax's layout.

        The HF tensor last read is kept, so reading the parts of a fused tensor one after the
        other (q, k, v of GPT-2's ``c_attn``) reads it once.
        """
        name = self._holder[path, layer]
        if self._cached is None or self._cached[0] != name:
            self._cached = None  # the previous tensor goes before the next is read
            self._cached = (name, {t.path: t.array for t in self._parts(name, self._entries[name])})
        return self._cached[1][path]

    def _parts(self, name: str, entry: _Entry) -> list[Tensor]:
        rule, shapes = entry.rule, zinfjax_shapes(self.config)
        a = self._files.get(name)
        zshapes = [_layer_shape(shapes, p) for p in rule.paths]
        sizes = [hf_shape(rule.layout, z, rule.in_axes)[FUSE_AXIS[rule.layout]] for z in zshapes]
        parts = np.split(a, np.cumsum(sizes)[:-1], axis=FUSE_AXIS[rule.layout]) if len(sizes) > 1 else [a]
        return [Tensor(path, entry.layer, to_zinfjax(rule.layout, part, zshape))
                for path, part, zshape in zip(rule.paths, parts, zshapes, strict=True)]

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self) -> list[tuple[str, _Entry]]:
        names = self._files.names()
        expected = _expected(self.table, self.config, _body(self.table, names))
        present = set(names)
        where = f"{self.directory} ({self.table.model_type}, {self.config.n_layers} layers)"
        missing = [n for n, e in expected.items() if e.rule.paths and n not in present]
        if missing:
            raise MissingTensorError(f"{where} lacks {_some(missing)}")
        unexpected = [n for n in names if n not in expected]
        if unexpected:
            raise UnexpectedTensorError(f"{where} holds tensors that zinfjax does not map: {_some(unexpected)}")
        shapes = zinfjax_shapes(self.config)
        for name in names:
            want, got = _hf_shape(expected[name], shapes), self._files.shape(name)
            if expected[name].rule.paths and got != want:
                raise ShapeMismatchError(f"{where}: tensor {name} has shape {got}, but config.json implies {want}")
        return [(n, expected[n]) for n in names if expected[n].rule.paths]


def load_hf(directory: str) -> tuple[ModelConfig, dict]:
    """Reads an HF checkpoint directory as a zinfjax `ModelConfig` and stacked params of numpy arrays.

    Example (a BERT, as all-MiniLM-L6-v2 is one; here a small random one, saved as Hugging Face saves one):
        >>> import tempfile
        >>> from zinfjax.models import BertInputs
        >>> bert = ModelConfig("bert", vocab_size=100, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
        >>> ids = jnp.array([[5, 6, 7, 0]]); mask = jnp.array([[1, 1, 1, 0]]); types = jnp.zeros_like(ids)
        >>> init = jax.jit(models.build(bert).init)(jax.random.key(0), BertInputs(ids, mask, types))["params"]
        >>> minilm_dir = tempfile.mkdtemp(); save_hf(init, bert, minilm_dir)
        >>> config, params = load_hf(minilm_dir)
        >>> out = jax.jit(models.build(config).apply)({"params": params}, BertInputs(ids, mask, types))
        >>> out.hidden.shape, out.pooled.shape
        ((1, 4, 32), (1, 32))
    """
    with HFCheckpoint(directory) as ckpt:
        flat = {p: np.empty(s.shape, s.dtype) for p, s in ckpt.like.items()}
        for path, layer, array in ckpt.tensors():
            flat[path][... if layer is None else layer] = array
        return ckpt.config, traverse_util.unflatten_dict(flat, sep="/")


def save_hf(params: Any, config: ModelConfig, directory: str) -> None:
    """Writes zinfjax params as an HF directory (config.json, model.safetensors) that transformers loads.

    GPT-2 and Llama are written as ``GPT2LMHeadModel`` / ``LlamaForCausalLM``, BERT as ``BertModel``.
    The values are moved, never changed: a checkpoint read by `load_hf` comes back bit for bit.

    Example:
        >>> import tempfile
        >>> config, rng = models.ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)   # a random GPT-2, saved
        >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
        >>> gpt2_dir = tempfile.mkdtemp()                      # as Hugging Face saves one
        >>> save_hf(params, config, gpt2_dir)
        >>> json.load(open(f"{gpt2_dir}/config.json"))["architectures"]   # transformers.AutoModelForCausalLM loads it
        ['GPT2LMHeadModel']
    """
    if config.arch not in BY_ARCH:
        raise UnknownArchitectureError(f"zinfjax cannot export arch {config.arch!r}; supported: {', '.join(BY_ARCH)}")
    flat = _check_params(params, config)
    write_hf(lambda p, layer: flat[p] if layer is None else flat[p][layer],
             {p: a.dtype for p, a in flat.items()}, config, directory)


def write_hf(read: Callable[[str, int | None], np.ndarray], dtypes: dict[str, Any], config: ModelConfig,
             directory: str, dtype: Any = None, on_tensor: Callable[[int], None] | None = None,
             max_shard_bytes: int = 5 * 10**9) -> dict:
    """Writes an HF directory (config.json, model.safetensors) one HF tensor at a time.

    ``read(path, layer)`` gives one layer of one zinfjax leaf (``layer`` None outside blocks) and
    ``dtypes`` each leaf's dtype, so the safetensors header is written before any tensor is read;
    then each HF tensor is assembled from its parts, cast to ``dtype`` (default: its own), written
    and dropped. Memory stays at one HF tensor. ``on_tensor(nbytes)`` follows each write.

    Past ``max_shard_bytes`` (5 GB, as transformers shards) the tensors go into shards
    ``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``, written last.
    A failure removes the shards already written.

    Returns:
        ``tensors``, ``bytes``, ``dtype`` (of the first tensor, as config.json records it) and ``files``.

    Example (a tree in memory, in bf16; ``zinfjax convert --to hf`` reads a checkpoint's leaves so):
        >>> import tempfile; config, rng = ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)
        >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(config).items()}
        >>> read = lambda path, layer: params[path] if layer is None else params[path][layer]
        >>> write_hf(read, {p: a.dtype for p, a in params.items()}, config, tempfile.mkdtemp(), "bfloat16")
        {'tensors': 52, 'bytes': 449280, 'dtype': 'bfloat16', 'files': 1}
    """
    stale = [f for f in (SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX) if os.path.exists(os.path.join(directory, f))]
    stale += sorted(os.path.basename(f) for f in glob.glob(os.path.join(directory, "model-*-of-*.safetensors")))
    if stale:
        raise CheckpointFilesError(f"{directory} already holds {', '.join(stale)}: write to an empty directory")
    specs = hf_specs(config, dtypes, dtype)  # refuses an unknown architecture
    entries = _export_entries(config)
    shards = _shards([_nbytes(dt, shape) for _, dt, shape in specs], max_shard_bytes)
    files = [SAFETENSORS] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                                    for k in range(len(shards))]
    os.makedirs(directory, exist_ok=True)
    written = 0
    try:
        for file, shard in zip(files, shards, strict=True):
            with SafetensorsWriter(os.path.join(directory, file), [specs[k] for k in shard]) as writer:
                for k in shard:
                    rule, layer = entries[k][1]
                    parts = [to_hf(rule.layout, read(p, layer), rule.in_axes) for p in rule.paths]
                    a = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=FUSE_AXIS[rule.layout])
                    del parts
                    a = a.astype(specs[k][1], copy=False)
                    writer.write(a)
                    if on_tensor is not None:
                        on_tensor(a.nbytes)
            written += writer.bytes_written
        if len(files) > 1:
            weight_map = {specs[k][0]: file for file, shard in zip(files, shards, strict=True) for k in shard}
            _write_json(os.path.join(directory, SAFETENSORS_INDEX),
                        {"metadata": {"total_size": written}, "weight_map": weight_map})
    except BaseException:
        for file in files:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, file))
        raise
    first = specs[0][1].name
    _write_json(os.path.join(directory, CONFIG), to_hf_config(config, first))
    return {"tensors": len(specs), "bytes": written, "dtype": first, "files": len(files)}


def hf_specs(config: ModelConfig, dtypes: dict[str, Any], dtype: Any = None) -> list[tuple[str, np.dtype, tuple]]:
    """Every HF tensor an export of ``config`` writes, in order: ``(name, dtype, shape)``.

    A tensor's dtype is ``dtype``, or else that of its (first) zinfjax leaf in ``dtypes``.

    Example:
        >>> dtypes = {path: np.float32 for path in zinfjax_shapes(ModelConfig.named("gpt2-tiny"))}
        >>> hf_specs(ModelConfig.named("gpt2-tiny"), dtypes)[0]
        ('transformer.wte.weight', dtype('float32'), (256, 64))
    """
    if config.arch not in BY_ARCH:
        raise UnknownArchitectureError(f"zinfjax cannot export arch {config.arch!r}; supported: {', '.join(BY_ARCH)}")
    shapes = zinfjax_shapes(config)
    return [(name, np.dtype(dtype if dtype is not None else dtypes[e.rule.paths[0]]), _hf_shape(e, shapes))
            for name, e in _export_entries(config)]


def _export_entries(config: ModelConfig) -> list[tuple[str, _Entry]]:
    """The HF tensors an export writes, with the rule and layer each comes from (tensors with no leaves left out)."""
    table = BY_ARCH[config.arch]
    return [(name, e) for name, e in _expected(table, config, table.bodies[0]).items() if e.rule.paths]


def _nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors grouped into shards of at most ``max_bytes`` (a larger tensor alone in its own).

    Example:
        >>> _shards([4, 4, 4, 10, 1], 8)
        [[0, 1], [2], [3], [4]]
    """
    shards: list[list[int]] = [[]]
    total = 0
    for k, size in enumerate(sizes):
        if shards[-1] and total + size > max_bytes:
            shards.append([])
            total = 0
        shards[-1].append(k)
        total += size
    return shards


@functools.cache
def zinfjax_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The stacked shape of every leaf of the zinfjax model for ``config``, by path (nothing is allocated).

    Example:
        >>> zinfjax_shapes(ModelConfig.named("gpt2-tiny"))["blocks/q/kernel"]
        (4, 64, 8, 8)
    """
    model = models.build(config)
    tree = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    shapes = {p: tuple(x.shape) for p, x in traverse_util.flatten_dict(tree, sep="/").items()}
    table = BY_ARCH[config.arch]
    mapped = sorted(p for r in table.active(config.tied) for p in r.paths)
    if mapped != sorted(shapes):  # a bug in the table, not in the user's input
        raise AssertionError(f"the {table.model_type} table maps {mapped}, the model has {sorted(shapes)}")
    return shapes


def _check_params(params: Any, config: ModelConfig) -> dict[str, np.ndarray]:
    flat = traverse_util.flatten_dict(dict(params), sep="/")
    shapes = zinfjax_shapes(config)
    missing = [p for p in shapes if p not in flat]
    if missing:
        raise MissingTensorError(f"params lack {_some(missing)}, which the {config.arch} model has")
    unexpected = [p for p in flat if p not in shapes]
    if unexpected:
        raise UnexpectedTensorError(f"params hold leaves the {config.arch} model does not have: {_some(unexpected)}")
    for p, want in shapes.items():
        if tuple(flat[p].shape) != want:
            raise ShapeMismatchError(f"params leaf {p} has shape {tuple(flat[p].shape)}, the config implies {want}")
    return {p: np.asarray(flat[p]) for p in shapes}


def _expected(table: ArchTable, config: ModelConfig, body: str) -> dict[str, _Entry]:
    """Every HF name the config implies, in the table's order, for the body prefix ``body``."""
    out = {}
    for rule in table.active(config.tied):
        for i in range(config.n_layers) if rule.per_layer else [None]:
            out[("" if rule.top else body) + rule.hf.format(i=i)] = _Entry(rule, i)
    return out


def _body(table: ArchTable, names: list[str]) -> str:
    """The body prefix the checkpoint uses: the one its first tensor (the embedding) is found under."""
    present = set(names)
    return next((b for b in table.bodies if b + table.rules[0].hf in present), table.bodies[0])


def _layer_shape(shapes: dict[str, tuple[int, ...]], path: str) -> tuple[int, ...]:
    return shapes[path][1:] if path.startswith("blocks/") else shapes[path]


def _hf_shape(entry: _Entry, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    rule = entry.rule
    hf = [hf_shape(rule.layout, _layer_shape(shapes, p), rule.in_axes) for p in rule.paths]
    if len(hf) <= 1:
        return hf[0] if hf else ()
    axis = FUSE_AXIS[rule.layout]
    return tuple(sum(s[axis] for s in hf) if k == axis else n for k, n in enumerate(hf[0]))


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
    return f"{len(names)} tensor{'s' if len(names) > 1 else ''}: {shown}"


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointFilesError(f"{path} is missing: a Hugging Face model directory needs its config.json")
    return read_mapping(path, "the Hugging Face config", CheckpointFilesError)


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


__all__ = ["HFCheckpoint", "TABLES", "Tensor", "load_hf", "save_hf", "write_hf", "zinfjax_shapes"]
