"""The bytes of each part of the training state, from the stores the engine would open, and the budgets they draw on."""

from __future__ import annotations

import math
import os
import shutil

import jax
import numpy as np

from zinfjax._util.byte_sizes import format_bytes
from zinfjax._util.choices import COMPUTE_DTYPES
from zinfjax.config import Config
from zinfjax.engine.budget import MARGIN_FRACTION, MARGIN_MIN, default_limit
from zinfjax.engine.stores import KIND_KEY
from zinfjax.planning.scale import parameter_count
from zinfjax.runtime import rss
from zinfjax.sections import Numerics, Tiering

KIND_TIER = KIND_KEY  # which tier key holds each kind of store


def _specs(config: Config, model_config) -> tuple[list, dict, int]:
    """The engine's stores for ``config`` on ``model_config`` as ``(kind, group, like)`` (nothing allocated),
    the groups it updates in parts (`zinfjax.engine.parts`), and the bytes of one step's saved residuals."""
    from zinfjax import models
    from zinfjax.engine import compiled
    from zinfjax.engine.parts import update_parts
    from zinfjax.engine.stores import spools_gradients, store_specs
    from zinfjax.program.residuals import residual_bytes
    from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules, make_mesh
    from zinfjax.trainers.optimizers import make_optimizer
    from zinfjax.trainers.streaming import lm_program

    compute = COMPUTE_DTYPES[config.precision]
    model = models.build(model_config, compute)
    mesh = make_mesh(config.mesh_axes())
    tx = make_optimizer(config)
    program, _ = lm_program(model, config, tx)
    rules = ShardingRules.for_mesh(mesh, config.stage, model.partition_rules, PERSISTENCE_THRESHOLD)
    layout = compiled(program, tx, rules, mesh, compute, config.grad_accum)
    plan = layout.plan
    tiering, numerics = config.section(Tiering), config.section(Numerics)
    specs, acts = store_specs(tiering, numerics, program, plan, layout.placement, compute)
    cut = update_parts(program, plan, specs, spools_gradients(numerics, plan))
    stores = [(s.kind, s.group, s.like) for s in specs] + [("acts", s.group, s.like) for s in acts.values()]
    return stores, cut, residual_bytes(program, config.grad_accum)


def tree_bytes(like) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(like))


def device_bytes(like) -> int:
    """Bytes the busiest device holds of a stacked tree: each leaf's shard."""
    total = 0
    for x in jax.tree.leaves(like):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def transient_bytes(config: Config, m) -> int:
    """The largest transient of one layer's forward and backward (float32): MLP and attention scores, or the logits."""
    rows = config.batch_size // config.grad_accum * config.seq_len
    layer = rows * (2 * m.d_ff + 6 * m.d_model) * 4 + config.batch_size // config.grad_accum * m.n_heads \
        * config.seq_len ** 2 * 4 * 2
    head = rows * m.vocab_size * 4 * 2
    return max(layer, head)


def state_parts(config: Config, model_config, stores=None) -> dict:
    """Bytes of each part of the state (whole, and on the busiest device), and the stores behind them."""
    stores = stores if stores is not None else _specs(config, model_config)[0]
    psi = parameter_count(model_config)
    by_kind: dict[str, int] = {}
    per_device: dict[str, int] = {}
    for kind, _, like in stores:
        by_kind[kind] = by_kind.get(kind, 0) + tree_bytes(like)
        per_device[kind] = per_device.get(kind, 0) + device_bytes(like)
    rows = config.batch_size // config.grad_accum * config.seq_len
    itemsize = 2 if config.precision != "fp32" else 4
    return {
        "parameters": psi,
        "params": by_kind.get("params", 0),
        "master": by_kind.get("master", 0),
        "optimizer": by_kind.get("opt", 0),
        "gradients": 4 * psi,  # fp32, what a step produces; stored only where spooled
        "gradients_stored": by_kind.get("grads", 0),
        "activations": by_kind.get("acts", 0),
        "activation_per_layer": config.grad_accum * rows * model_config.d_model * itemsize,
        "activation_transient": transient_bytes(config, model_config),
        "per_device": per_device,
    }


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def nvme_free(nvme_path: str | None) -> int | None:
    """Free bytes on the filesystem of ``nvme_path`` (or of its nearest existing parent); None without a path."""
    return shutil.disk_usage(_existing(nvme_path)).free if nvme_path else None


def budgets(config: Config, baseline: int | None = None) -> dict:
    """The host budget (and its source), the device memory (None on the CPU backend: it is host memory), NVMe, and
    what the process holds already (``baseline``: this process's resident memory unless given). Placements fit
    ``host_bytes``, a margin below ``memory_limit``; the engine's regime is judged at ``engine_host_bytes``, the
    whole ``memory_limit``, which is what its budget divides."""
    if config.memory_limit:  # less the margin the default budget keeps: what the engine counts is not all it holds
        margin = max(MARGIN_MIN, int(MARGIN_FRACTION * config.memory_limit))
        host, source = int(config.memory_limit) - margin, f"memory_limit less a {format_bytes(margin)} margin"
        engine = int(config.memory_limit)
    else:
        host, source = default_limit()
        engine = host
    device = jax.devices()[0]
    device_limit = None
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        device_limit = stats.get("bytes_limit")
    return {"platform": device.platform, "host_bytes": host, "host_source": source, "device_bytes": device_limit,
            "engine_host_bytes": engine,  # the engine's own budget (`zinfjax.engine.budget.make_budget`): no margin
            "nvme_free_bytes": nvme_free(config.nvme_path),
            "baseline_bytes": rss.current_bytes() if baseline is None else baseline}
