"""Hugging Face checkpoint files: read one tensor at a time, write one safetensors file.

Reads ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``) and
``pytorch_model.bin`` (single or sharded with ``pytorch_model.bin.index.json``). Names and
shapes come from the file headers, so a checkpoint can be checked whole before any tensor is
read; then `TensorFiles.get` reads one tensor, so memory holds one tensor at a time.

Example:
    >>> import tempfile
    >>> llama_dir = tempfile.mkdtemp()                   # a Llama's model.safetensors: here, its final norm alone
    >>> write_safetensors(f"{llama_dir}/model.safetensors", {"model.norm.weight": np.ones(128, np.float32)})
    >>> with TensorFiles.open(llama_dir) as files:
    ...     shape = files.shape("model.norm.weight")     # from the header
    ...     norm = files.get("model.norm.weight")        # numpy, read now
    >>> shape, type(norm).__name__
    ((128,), 'ndarray')
"""

from __future__ import annotations

import json
import os
import pickle
from contextlib import ExitStack

import ml_dtypes
import numpy as np
import safetensors
import torch

from zinfjax._util.mapping_files import read_mapping
from zinfjax_interop.errors import CheckpointFilesError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class TensorFiles:
    """The tensors of a checkpoint directory, by name, across its files."""

    def __init__(self, directory: str, where: dict[str, str]):
        self.directory = directory
        self._where = where  # tensor name -> file name
        self._stack = ExitStack()
        self._open: dict[str, object] = {}

    @staticmethod
    def open(directory: str) -> TensorFiles:
        """Opens the checkpoint files in ``directory``, preferring safetensors.

        Example:
            >>> import tempfile
            >>> gpt2_dir = tempfile.mkdtemp()
            >>> write_safetensors(f"{gpt2_dir}/model.safetensors", {"transformer.ln_f.bias": np.zeros(64, np.float32)})
            >>> files = TensorFiles.open(gpt2_dir)
            >>> files.names()
            ['transformer.ln_f.bias']
            >>> files.close()
        """
        for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (TORCH_BIN, TORCH_BIN_INDEX)):  # transformers' order
            if os.path.exists(os.path.join(directory, single)):
                return TensorFiles(directory, {name: single for name in _names(directory, single)})
            if os.path.exists(os.path.join(directory, index)):
                weights = read_mapping(os.path.join(directory, index), "the index", CheckpointFilesError)
                if not isinstance(weights.get("weight_map"), dict):
                    raise CheckpointFilesError(f"{os.path.join(directory, index)} has no weight_map object: it is "
                                               "not an index that transformers writes")
                return TensorFiles(directory, dict(weights["weight_map"]))
        raise CheckpointFilesError(
            f"{directory} has none of {SAFETENSORS}, {SAFETENSORS_INDEX}, {TORCH_BIN}, {TORCH_BIN_INDEX}: "
            "point at a Hugging Face model directory (what save_pretrained writes)"
        )

    def names(self) -> list[str]:
        """Every tensor name, grouped by file so that reading them in order opens each file once."""
        return sorted(self._where, key=lambda n: self._where[n])

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from the file header (nothing is read)."""
        f = self._file(name)
        if isinstance(f, dict):
            return tuple(f[name].shape)
        return tuple(f.get_slice(name).get_shape())

    def dtype(self, name: str) -> np.dtype:
        """The dtype of tensor ``name``, from the file header (nothing is read)."""
        f = self._file(name)
        if isinstance(f, dict):
            return _numpy(torch.empty(0, dtype=f[name].dtype)).dtype
        code = f.get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointFilesError(f"tensor {name} has dtype {code}, which zinfjax does not read")
        return np.dtype(_DTYPES[code])

    def get(self, name: str) -> np.ndarray:
        """Reads tensor ``name`` as a numpy array (bfloat16 as ``ml_dtypes.bfloat16``)."""
        f = self._file(name)
        return _numpy(f[name] if isinstance(f, dict) else f.get_tensor(name))

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _file(self, name: str):
        filename = self._where[name]
        if filename not in self._open:
            path = os.path.join(self.directory, filename)
            if not os.path.exists(path):
                raise CheckpointFilesError(f"{path} is missing: the index names it for tensor {name}")
            self._open[filename] = _open_file(self._stack, path)
        return self._open[filename]


def _open_file(stack: ExitStack, path: str):
    try:
        if path.endswith(".safetensors"):
            return stack.enter_context(safetensors.safe_open(path, framework="pt"))
        # mmap: tensors stay in the file until read; weights_only: no code runs from the file.
        return _torch_load(path)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise CheckpointFilesError(f"{path} cannot be unpickled ({e}); re-save it with torch.save") from e
        refused = next((line.strip() for line in str(e).splitlines() if "global" in line.lower()), "")
        raise CheckpointFilesError(
            f"{path} holds objects other than tensors, which could run code when unpickled ({refused}); zinfjax "
            "loads .pt files with torch.load(weights_only=True) and never runs code from a file: save "
            "model.state_dict() (tensors only), or safetensors"
        ) from e
    except (OSError, RuntimeError, safetensors.SafetensorError) as e:
        raise CheckpointFilesError(
            f"{path} cannot be read ({e}); re-save it with save_pretrained (safetensors) or torch.save"
        ) from e


def _torch_load(path: str):
    """torch.load with weights_only; memory-mapped unless the file predates torch's zip format."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # the legacy format is read whole


def _names(directory: str, filename: str) -> list[str]:
    with ExitStack() as stack:
        f = _open_file(stack, os.path.join(directory, filename))
        return list(f.keys())


_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class StateDictFile(TensorFiles):
    """A torch ``state_dict`` saved with ``torch.save`` (.pt/.pth/.bin), or one .safetensors file, by tensor name.

    The file is memory-mapped and unpickled with ``weights_only=True``, so no code in it runs. A training
    checkpoint that nests the state dict (``{"model": state_dict, "optimizer": ...}``) is read from its
    ``state_dict``, ``model`` or ``module`` entry.

    Example:
        >>> import tempfile
        >>> path = f"{tempfile.mkdtemp()}/model.pt"
        >>> torch.save({"model": {"transformer.wte.weight": torch.zeros(256, 64)}, "iter_num": 7}, path)
        >>> with StateDictFile(path) as f:                    # a training checkpoint: its "model" entry
        ...     f.shape("transformer.wte.weight"), f.get("transformer.wte.weight").dtype
        ((256, 64), dtype('float32'))
    """

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise CheckpointFilesError(f"{path} does not exist")
        directory, filename = os.path.split(os.path.abspath(path))
        super().__init__(directory, {})
        try:
            opened = _open_file(self._stack, path)
            tensors = opened if path.endswith(".safetensors") else _state_dict(opened, path)
        except BaseException:
            self.close()
            raise
        self._open[filename] = tensors
        self._where = dict.fromkeys(tensors.keys(), filename)


def _state_dict(obj, path: str) -> dict:
    """The tensors of a torch.load'ed object: a state dict, or one nested under a usual key."""
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "module"):
            inner = obj.get(key)
            if isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
        others = [f"{k} ({type(v).__name__})" for k, v in obj.items() if not isinstance(v, torch.Tensor)]
        raise CheckpointFilesError(
            f"{path} is not a state_dict of tensors: it holds {', '.join(others[:5])}; save model.state_dict() "
            "(or a dict with it under 'state_dict', 'model' or 'module')"
        )
    raise CheckpointFilesError(f"{path} holds a {type(obj).__name__}, not a state_dict; save model.state_dict()")


_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsWriter:
    """One safetensors file written one tensor at a time, so memory holds one tensor.

    The header (every name, dtype, shape and byte offset) is written first, from ``specs``; then
    each `write` appends the next tensor's bytes, in the order of ``specs``. The file is written
    under a temporary name and renamed into place (after an fsync) only by `close` once every
    tensor is in; `abort`, or an exception inside ``with``, removes it.

    Example:
        >>> import safetensors.numpy, tempfile
        >>> path = f"{tempfile.mkdtemp()}/model.safetensors"
        >>> specs = [("ln_f.weight", np.float32, (8,)), ("ln_f.bias", np.float32, (8,))]
        >>> with SafetensorsWriter(path, specs) as w:
        ...     w.write(np.ones(8, np.float32))
        ...     w.write(np.zeros(8, np.float32))
        >>> sorted(safetensors.numpy.load_file(path))          # what any safetensors reader finds
        ['ln_f.bias', 'ln_f.weight']
    """

    def __init__(self, path: str, specs: list[tuple[str, object, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path, self._tmp = path, path + ".tmp"
        self._specs = [(name, np.dtype(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in specs]
        header, offset = {"__metadata__": dict(metadata or {"format": "pt"})}, 0
        for name, dtype, shape in self._specs:
            if dtype not in _CODES:
                raise ValueError(f"tensor {name}: safetensors has no code for dtype {dtype}")
            end = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._file = open(self._tmp, "wb")
        self._file.write(len(text).to_bytes(8, "little") + text)
        self._next = 0
        self.bytes_written = 0

    def write(self, array: np.ndarray) -> None:
        """Appends the next tensor of ``specs``; its dtype and shape must be the spec's."""
        name, dtype, shape = self._specs[self._next]
        array = np.asarray(array)
        if array.dtype != dtype or array.shape != shape:
            raise ValueError(f"tensor {name}: got {array.dtype}{list(array.shape)}, the header says "
                             f"{dtype}{list(shape)}")
        self._file.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self._next += 1
        self.bytes_written += array.nbytes

    def close(self) -> None:
        """Checks every tensor was written, makes the file durable and renames it into place."""
        if self._next != len(self._specs):
            self.abort()
            raise ValueError(f"{self.path}: {len(self._specs) - self._next} tensors were never written, "
                             f"from {self._specs[self._next][0]} on")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._file.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes ``tensors`` as one safetensors file that transformers loads, atomically.

    Example:
        >>> import tempfile
        >>> path = f"{tempfile.mkdtemp()}/model.safetensors"
        >>> write_safetensors(path, {"ln_f.weight": np.ones(8, np.float32)})
        >>> with StateDictFile(path) as f:
        ...     f.get("ln_f.weight").sum()
        np.float32(8.0)
    """
    with SafetensorsWriter(path, [(name, a.dtype, a.shape) for name, a in tensors.items()]) as writer:
        for a in tensors.values():
            writer.write(a)
