"""Meshes and the sharding rules of the ZeRO stages.

Example:
    >>> mesh = make_mesh({"data": -1})
    >>> batch_sharding(mesh)
    NamedSharding(mesh=..., spec=PartitionSpec('data',))
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax.errors import ConfigError


def make_mesh(axes: dict[str, int], devices: list | None = None) -> Mesh:
    """A ``("data", "model")`` mesh; an axis of -1 takes every remaining device.

    Example:
        >>> make_mesh({"data": 4, "model": 2}).shape
        {'data': 4, 'model': 2}
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = {"data": axes.get("data", 1), "model": axes.get("model", 1)}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    for name, size in sizes.items():
        if size == -1:
            if len(devices) % fixed:
                raise ConfigError(f"mesh {axes}: {len(devices)} devices do not divide by {fixed}")
            sizes[name] = len(devices) // fixed
    total = sizes["data"] * sizes["model"]
    if total > len(devices):
        raise ConfigError(f"mesh {axes} needs {total} devices but {len(devices)} are available")
    grid = np.array(devices[:total]).reshape(sizes["data"], sizes["model"])
    return Mesh(grid, ("data", "model"))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split over the ``data`` axis on their first dimension."""
    return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_batch(batch_size: int, mesh: Mesh, grad_accum: int = 1) -> None:
    """Refuses a batch that does not split evenly over micro-batches and the data axis."""
    data = mesh.shape["data"]
    if batch_size % grad_accum or (batch_size // grad_accum) % data:
        raise ConfigError(
            f"batch_size={batch_size} must divide into grad_accum={grad_accum} micro-batches "
            f"whose size divides by the {data} devices of the data axis"
        )
