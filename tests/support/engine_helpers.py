"""Shared runs for the engine tests: the reference trainer and the engine on the same seed and data."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zinfjax import Config, models
from zinfjax.data import Batches, load_tokens
from zinfjax.engine import Engine, TreeSource
from zinfjax.engine.stores import store_specs
from zinfjax.models.stacked import lm_init, lm_loss
from zinfjax.planning.zero_memory import zero_formula
from zinfjax.sharding import make_mesh, replicated
from zinfjax.trainers.optimizers import make_optimizer
from zinfjax.trainers.reference import init_state, make_step
from zinfjax.trainers.streaming import lm_engine

STEPS = 20
BASE = dict(model="gpt2-tiny", batch_size=8, seq_len=16, lr=1e-3, mesh="data:4")


def config(**kw) -> Config:
    return Config(**{**BASE, **kw})


@functools.cache
def tokens():
    return load_tokens("demo")


def batches(c: Config):
    return Batches(tokens(), c.batch_size, c.seq_len, c.seed)


@functools.cache
def _tx(c: Config):
    return make_optimizer(c)


def reference_run(c: Config, steps: int = STEPS):
    """Losses and final params of the in-memory reference trainer."""
    return _reference(c, steps, jnp.float32)


@functools.cache
def exact_run(c: Config, steps: int = STEPS):
    """The reference trainer in float64 from the same fp32 initial params: the truth that fp32 runs are judged
    against, whatever order they sum in (tests/support/tolerances.py). Cached: many tests ask for the same one."""
    return _reference(c, steps, jnp.float64)


def _reference(c: Config, steps: int, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        model = models.build(c.model, dtype)
        mesh = make_mesh(c.mesh_axes())
        params = jax.tree.map(lambda x: x.astype(dtype), initial_params(c))
        opt = jax.jit(_tx(c).init, out_shardings=replicated(mesh))(params)
        step = make_step(lm_loss(model), _tx(c), mesh, c.grad_accum)
        data, losses = batches(c), []
        for _ in range(steps):
            params, opt, loss = step(params, opt, next(data))
            losses.append(float(loss))
        return losses, jax.tree.map(np.asarray, params)


@functools.cache
def _host_params(model: str, seed: int, seq_len: int):
    """Initial params on the host, computed once per model and seed (as `init_state` computes them); in fp32 even
    where the first to ask is `exact_run`, under ``jax.enable_x64`` (which draws other values, some float64)."""
    with jax.enable_x64(False):
        params, _ = init_state(lm_init(models.build(model)), optax.identity(), make_mesh({"data": 1}), seed)
    return jax.tree.map(np.asarray, params)


def initial_params(c: Config):
    """The initial params of ``c``, replicated on its mesh."""
    return jax.device_put(_host_params(c.model, c.seed, c.seq_len), replicated(make_mesh(c.mesh_axes())))


def make_engine(c: Config, source=None, tx=None) -> Engine:
    """An engine for ``c``, filled with the same initial params as the reference (or from ``source``)."""
    if source is None:
        params = initial_params(c)
        source = lambda program, plan: TreeSource(program, plan, params)  # noqa: E731
    return lm_engine(models.build(c.model), c, make_mesh(c.mesh_axes()), source=source, tx=tx or _tx(c))


def engine_specs(engine: Engine) -> tuple[list, dict]:
    """The specs of an engine's stores and its activations' by scan, as it planned them from its settings."""
    s, e = engine.settings, engine
    return store_specs(s.tiering, s.numerics, e.program, e.update_plan, e.placement, e.compute_dtype)


def engine_run(c: Config, steps: int = STEPS):
    """Losses, final params and per-step metrics of the engine."""
    engine = make_engine(c)
    try:
        data, losses, metrics = batches(c), [], []
        for _ in range(steps):
            m = engine.train_step(next(data))
            losses.append(m["loss"])
            metrics.append(m)
        params = jax.tree.map(np.asarray, engine.params())
    finally:
        engine.close()
    return losses, params, metrics


# GPT-2's key bias adds the same amount to every score of a softmax row, so its true gradient is
# zero; Adam normalises the rounding noise into full-size steps, so this leaf follows noise alone.
ZERO_GRADIENT_LEAVES = ("['blocks']['k']['bias']",)


def relative_error(a, b) -> float:
    """||a - b|| / ||a|| over the leaves of two parameter trees, less those with a zero true gradient."""
    keep = [jax.tree_util.keystr(p) not in ZERO_GRADIENT_LEAVES for p, _ in jax.tree_util.tree_leaves_with_path(a)]
    la = [x for x, k in zip(jax.tree.leaves(a), keep, strict=True) if k]
    lb = [x for x, k in zip(jax.tree.leaves(b), keep, strict=True) if k]
    num = sum(float(np.sum((np.float64(x) - np.float64(y)) ** 2)) for x, y in zip(la, lb, strict=True))
    den = sum(float(np.sum(np.float64(x) ** 2)) for x in la)
    return (num / den) ** 0.5


def assert_bitwise(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# ---- ZeRO's memory formulas, computed from the parameter shapes and the documented threshold rule ----


def _psi_split(leaves, n: int, threshold: int):
    """(Ψ sharded, Ψ replicated): leaves below the threshold, or with no divisible dimension, stay whole."""
    sharded = whole = 0
    for x in leaves:
        size = math.prod(x.shape)
        if size >= threshold and any(d % n == 0 for d in x.shape):
            sharded += size
        else:
            whole += size
    return sharded, whole


def _per_layer(abstract):
    """Per-layer leaves (blocks lose the layer axis) repeated per layer, so the rule sees each layer's shape."""
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(abstract):
        stacked = jax.tree_util.keystr(path).startswith("['blocks']")
        layers, shape = (x.shape[0], x.shape[1:]) if stacked else (1, x.shape)
        out += [jax.ShapeDtypeStruct(shape, x.dtype)] * layers
    return out


def expected_state_bytes(abstract, tx, stage: int, n: int, p: int, g: int, k: int, threshold: int) -> float:
    """ZeRO's formula on the sharded parameters, plus the replicated remainder and the optimizer step count."""
    psi_s, psi_r = _psi_split(_per_layer(abstract), n, threshold)
    state = jax.eval_shape(tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), abstract))
    counts = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if not jnp.issubdtype(x.dtype, jnp.floating))
    return zero_formula(stage, psi_s, n, p, g, k) + (p + g + k) * psi_r + counts
