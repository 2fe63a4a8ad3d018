"""Hugging Face checkpoint files: read one tensor at a time, write one safetensors file.

Reads ``model.safetensors``, sharded safetensors (``model.safetensors.index.json``) and
``pytorch_model.bin`` (single or sharded with ``pytorch_model.bin.index.json``). Names and
shapes come from the file headers, so a checkpoint can be checked whole before any tensor is
read; then `TensorFiles.get` reads one tensor, so memory holds one tensor at a time.

Example:
    >>> with TensorFiles.open("llama-dir") as files:
    ...     shape = files.shape("model.norm.weight")
    ...     norm = files.get("model.norm.weight")      # numpy
"""

from __future__ import annotations

import json
import os
import pickle
from contextlib import ExitStack

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
import torch

from interop.errors import CheckpointFilesError

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
            >>> files = TensorFiles.open("gpt2-dir")
        """
        for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (TORCH_BIN, TORCH_BIN_INDEX)):  # transformers' order
            if os.path.exists(os.path.join(directory, single)):
                return TensorFiles(directory, {name: single for name in _names(directory, single)})
            if os.path.exists(os.path.join(directory, index)):
                with open(os.path.join(directory, index)) as f:
                    return TensorFiles(directory, dict(json.load(f)["weight_map"]))
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
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError, safetensors.SafetensorError) as e:
        raise CheckpointFilesError(
            f"{path} cannot be read ({e}); re-save it with save_pretrained (safetensors) or torch.save"
        ) from e


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


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes ``tensors`` as one safetensors file that transformers loads, atomically.

    Example:
        >>> write_safetensors("out/model.safetensors", {"ln_f.weight": np.ones(8, np.float32)})
    """
    tmp = path + ".tmp"
    contiguous = {name: np.ascontiguousarray(a) for name, a in tensors.items()}
    safetensors.numpy.save_file(contiguous, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
