"""The streaming step: a prefetching scan over layers, with every part of the state on its tier.

Forward reads each layer's parameters ``prefetch_depth`` layers ahead and writes the
layer-boundary activations to their tier. Backward walks the layers in reverse, reads
parameters, activation and optimizer state ahead, recomputes each layer inside its VJP,
and hands the layer's gradient to the optimizer at once. When the step needs every
gradient first (global-norm clipping, fp16 overflow checks) gradients are spooled to the
gradient tier and applied in a second sweep. See DESIGN.md, "The one idea".

ZeRO stages 0-3 and tensor parallelism are sharding rules (zinfjax/sharding.py): every store
holds its leaves in their kind's layout, the layer functions gather parameters and scatter
gradients inside their jitted bodies, and each update runs on the optimizer state's shards.
See docs/sharding.md.
"""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax import allocator
from zinfjax.config import Config
from zinfjax.engine import progress
from zinfjax.engine.functions import Layout, make_layer_functions
from zinfjax.engine.readahead import Read, ReadAhead
from zinfjax.engine.stores import GROUPS, build_stores, opt_like, plan_stores
from zinfjax.engine.telemetry import StepTelemetry
from zinfjax.engine.update import check_elementwise, make_update, spool_grads
from zinfjax.models.layered import Layers, check_params
from zinfjax.reference import micro_batches
from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules, check_batch

COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
WRITES_PER_LAYER = 4  # the most one layer's step issues: params, opt, master, and acts or grads


class LossScale:
    """Dynamic fp16 loss scaling with DeepSpeed's defaults: skip and halve on overflow, double after 1000."""

    def __init__(self, enabled: bool, initial: float = 2.0**16, window: int = 1000, minimum: float = 1.0):
        self.enabled, self.scale, self.window, self.minimum, self.good = enabled, initial, window, minimum, 0

    @property
    def value(self) -> float:
        return self.scale if self.enabled else 1.0

    def after_step(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good = max(self.scale / 2, self.minimum), 0
            return
        self.good += 1
        if self.good >= self.window:
            self.scale, self.good = self.scale * 2, 0


class Engine:
    """Trains a layered model with its state on the tiers of ``config``.

    ``config.stage`` shards the state over the mesh axis ``data``; a ``model`` axis splits it
    by ``layers.partition_rules``. Leaves with fewer than ``persistence_threshold`` elements
    stay whole on every device (see zinfjax/sharding.py).

    Example:
        >>> engine = Engine(model.layers(), params, optax.adamw(1e-3), config, mesh, batch_shape=(8, 65))
        >>> metrics = engine.train_step(batch)
    """

    def __init__(self, layers: Layers, params, tx: optax.GradientTransformation, config: Config, mesh: Mesh,
                 batch_shape: tuple[int, int], persistence_threshold: int = PERSISTENCE_THRESHOLD):
        check_elementwise(tx)
        # A ParamSource, a zinfjax.checkpoint.CheckpointSource, or a parameter tree.
        source = params if hasattr(params, "abstract") else ParamSource.from_tree(params)
        self.num_layers = check_params(source.abstract)
        check_batch(batch_shape[0], mesh, config.grad_accum)
        self.config, self.mesh, self.tx = config, mesh, tx
        self.compute_dtype = COMPUTE_DTYPES[config.precision]
        self.spool = config.grad_clip > 0 or config.precision == "fp16"
        self.loss_scale = LossScale(config.precision == "fp16")
        self.rules = ShardingRules.for_mesh(mesh, config.stage, layers.partition_rules, persistence_threshold)
        self.fns = make_layer_functions(layers, Layout(self.rules.canonical(["grads"]), mesh))
        update_layout = Layout(self.rules.canonical(["params", "opt", "master"]), mesh)
        self.updates = {g: make_update(tx, self.compute_dtype, update_layout, g) for g in GROUPS}
        self.step_count = 0
        self._steps_run = 0
        self.tracer = None  # a zinfjax.engine.trace.Tracer while one is attached
        self._writes: collections.deque = collections.deque()  # writes in flight, oldest first
        # A layer of writes in flight per layer read ahead, and at least two: reads and writes share the disk,
        # and with one the next layer's update waits for the last write to land (docs/BENCHMARKS.md).
        self._max_writes = WRITES_PER_LAYER * max(2, config.prefetch_depth)
        self._sumsq_parts: list = []
        self._telemetry: StepTelemetry | None = None  # the step in progress
        self.data_sharding = NamedSharding(mesh, P(None, "data"))
        abstract = source.abstract
        plan = plan_stores(config, mesh, self.rules, abstract, self._opt_like(abstract),
                           self._act_like(abstract, batch_shape), self.spool, self.compute_dtype)
        self.stores = build_stores(config, plan)
        self.interrupted_step = progress.interrupted(config)  # a step a killed process left half done
        try:
            self._fill(source)
        except BaseException:
            self.stores.close()
            raise
        self._release_scratch()

    # ---- set-up ------------------------------------------------------------------------------

    def _release_scratch(self) -> None:
        """With the state on nvme, memory is the budget: give the compiler's freed scratch back to the system."""
        if self.config.uses_nvme:
            allocator.trim()

    def _opt_like(self, abstract):
        return opt_like(self.tx, abstract)

    def _act_like(self, params, batch_shape):
        """The activation checkpoint of one step: (L, micro-batches, rows, T, D) in what embed returns."""
        a = self.config.grad_accum
        b, t = batch_shape[0] // a, batch_shape[1] - 1
        embed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), self.compute_dtype), params["embed"])
        h = jax.eval_shape(self.fns.embed_fwd, embed, jax.ShapeDtypeStruct((a, b, t), jnp.int32))
        sharding = NamedSharding(self.mesh, P(None, None, "data"))
        return {"h": jax.ShapeDtypeStruct((self.num_layers, *h.shape), h.dtype, sharding=sharding)}

    def _fill(self, source: ParamSource) -> None:
        """Writes the initial state into the stores, one layer at a time."""
        if hasattr(source, "fill"):  # a checkpoint
            source.fill(self)
            return
        for g in GROUPS:
            stores = [self.stores.params[g], self.stores.opt[g]]
            stores += [self.stores.master[g]] if self.stores.master else []
            for i in range(self.num_layers if g == "blocks" else 1):
                compute, master, opt = self._init_layer(source.layer(g, i))
                for store, tree in zip(stores, (compute, opt, master), strict=False):
                    self._write("fill", store, i, tree)
            self.stores.flush()

    @property
    def _init_layer(self):
        return _make_init(self.tx, self.compute_dtype)

    # ---- the step ----------------------------------------------------------------------------

    def train_step(self, batch) -> dict:
        """One optimizer step on ``batch`` (B, T+1); returns the step's metrics."""
        progress.begin(self.config, self.step_count + 1)
        telemetry = self._telemetry = StepTelemetry(self.stores.all(), self.tracer)
        tokens = jax.device_put(micro_batches(np.asarray(batch), self.config.grad_accum), self.data_sharding)
        x, y = tokens[:, :, :-1], tokens[:, :, 1:]
        written: set[int] = set()
        reads = ReadAhead(self._schedule(written), self.config.prefetch_depth)
        scale = jnp.float32(self.loss_scale.value)

        (pe,) = next(reads)
        h = self._run("embed_fwd", 0, self.fns.embed_fwd, pe, x)
        for i in range(self.num_layers):
            (p,) = next(reads)
            self._write("acts", self.stores.acts, i, {"h": h})
            written.add(i)
            h = self._run("block_fwd", i, self.fns.block_fwd, p, h)

        ph, pe, *head_opt = next(reads)
        loss, dh, g_head, g_embed_tied = self._run("head", 0, self.fns.head_fwd_bwd, ph, pe, h, y, scale)
        self._finish("head", 0, ph, g_head, head_opt)
        for i in reversed(range(self.num_layers)):
            p, act, *opt = next(reads)
            dh, g = self._run("block_bwd", i, self.fns.block_bwd, p, act["h"], dh)
            self._finish("blocks", i, p, g, opt)
        pe, *embed_opt = next(reads)
        g_embed = jax.tree.map(jnp.add, self._run("embed_bwd", 0, self.fns.embed_bwd, pe, x, dh), g_embed_tied)
        self._finish("embed", 0, pe, g_embed, embed_opt)
        telemetry.add_reads(reads)

        skipped = False
        if self.spool:
            skipped = self._apply_spooled(telemetry)
        loss = float(loss)
        self.stores.flush()
        self.step_count += 0 if skipped else 1
        progress.end(self.config)
        self._telemetry = None
        if not self._steps_run:
            self._release_scratch()  # the first step compiled every layer function
        self._steps_run += 1
        return telemetry.finish(loss=loss, skipped=skipped, loss_scale=self.loss_scale.value)

    def _schedule(self, written: set[int]) -> list[list[Read]]:
        """Every read of a step, grouped by the layer compute that needs them, in order."""
        s, L = self.stores, self.num_layers
        fused = not self.spool

        def opt_reads(g, i):
            if not fused:
                return []
            reads = [Read(f"opt_{g}", s.opt[g], i)]
            return reads + ([Read(f"master_{g}", s.master[g], i)] if s.master else [])

        groups = [[Read("params_embed", s.params["embed"], 0)]]
        groups += [[Read("params_blocks", s.params["blocks"], i)] for i in range(L)]
        groups.append([Read("params_head", s.params["head"], 0), Read("params_embed", s.params["embed"], 0),
                       *opt_reads("head", 0)])
        for i in reversed(range(L)):
            act = Read("acts", s.acts, i, ready=lambda i=i: i in written)
            groups.append([Read("params_blocks", s.params["blocks"], i), act, *opt_reads("blocks", i)])
        groups.append([Read("params_embed", s.params["embed"], 0), *opt_reads("embed", 0)])
        return groups

    def _finish(self, group: str, i: int, params, grads, opt) -> None:
        """Hands one layer's gradient on: applied now (fused), or spooled for the second sweep."""
        if self.spool:
            grads, sumsq = spool_grads(grads)
            self._write(f"grads_{group}", self.stores.grads[group], i, grads)
            self._sumsq_parts.append(sumsq)
            return
        master = opt[1] if len(opt) > 1 else params
        self._apply(group, i, master, grads, opt[0], jnp.float32(0), jnp.float32(jnp.inf), jnp.float32(1))

    def _apply(self, group, i, master, grads, opt, g_norm, max_norm, grad_div) -> None:
        name = "update" if group == "blocks" else f"update_{group}"
        compute, master, opt = self._run(name, i, self.updates[group], master, grads, opt, g_norm, max_norm, grad_div)
        self._write(f"params_{group}", self.stores.params[group], i, compute)
        self._write(f"opt_{group}", self.stores.opt[group], i, opt)
        if self.stores.master:
            self._write(f"master_{group}", self.stores.master[group], i, master)

    def _run(self, name: str, layer: int, fn, *args):
        """``fn(*args)``, dispatched asynchronously; an attached tracer gets the dispatch time and the result."""
        if self.tracer is None:
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        self.tracer.compute(name, layer, t0, out)
        return out

    def _write(self, track: str, store, i: int, tree) -> None:
        t0 = time.perf_counter()
        future = store.write(i, tree)
        if self._telemetry is not None:
            self._telemetry.add_write(store)
        if self.tracer is not None:
            self.tracer.write(track, i, t0, future)
        # A write holds its layer in memory until it lands; without a bound, a disk slower than
        # compute would let that backlog grow with the number of layers (DESIGN.md, invariant 2).
        self._writes.append(future)
        while self._writes and (self._writes[0].done() or len(self._writes) > self._max_writes):
            self._writes.popleft().exception()  # errors surface at the next flush

    def _apply_spooled(self, telemetry: StepTelemetry) -> bool:
        """The second sweep: global norm, overflow check, then every layer's update."""
        parts, self._sumsq_parts = self._sumsq_parts, []
        grad_div = jnp.float32(self.loss_scale.value)
        g_norm = jnp.sqrt(sum(parts)) / grad_div
        finite = bool(jnp.isfinite(g_norm))
        self.loss_scale.after_step(finite)
        if not finite:
            return True
        max_norm = jnp.float32(self.config.grad_clip if self.config.grad_clip > 0 else jnp.inf)
        s = self.stores
        units = [("head", 0)] + [("blocks", i) for i in reversed(range(self.num_layers))] + [("embed", 0)]
        groups = []
        for g, i in units:
            source = s.master[g] if s.master else s.params[g]
            groups.append([Read(f"grads_{g}", s.grads[g], i), Read(f"opt_{g}", s.opt[g], i),
                           Read(f"master_{g}" if s.master else f"params_{g}", source, i)])
        reads = ReadAhead(groups, self.config.prefetch_depth)
        for (g, i), (grads, opt, master) in zip(units, reads, strict=True):
            self._apply(g, i, master, grads, opt, g_norm, max_norm, grad_div)
        telemetry.add_reads(reads)
        return False

    # ---- reading the state back --------------------------------------------------------------

    def params(self, kind: str = "params"):
        """The whole parameter tree (``kind`` = params or master), gathered into memory."""
        stores = getattr(self.stores, kind)
        out = {}
        for g in GROUPS:
            tree = stores[g].read_all()
            out[g] = tree if g == "blocks" else jax.tree.map(lambda x: x[0], tree)
        return out

    def close(self) -> None:
        self.stores.close()


@functools.lru_cache(maxsize=32)
def _make_init(tx: optax.GradientTransformation, compute_dtype):
    """A jitted ``init(layer) -> (compute, master, opt_state)`` (cached, so engines share its compiles)."""

    def init(layer):
        master = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), layer)
        return jax.tree.map(lambda x: x.astype(compute_dtype), master), master, tx.init(master)

    return jax.jit(init)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


class ParamSource:
    """Where the initial parameters come from, one layer at a time.

    ``abstract`` is the whole tree as ``ShapeDtypeStruct`` leaves; ``layer(group, i)`` returns
    one layer of a group (the whole group for ``embed`` and ``head``). A model larger than
    memory is initialised through a source that builds each layer on demand.

    Example:
        >>> ParamSource.from_tree(params).layer("blocks", 3)
    """

    def __init__(self, abstract, layer):
        self.abstract, self.layer = abstract, layer

    @classmethod
    def from_tree(cls, params) -> ParamSource:
        check_params(params)

        def layer(group, i):
            return jax.tree.map(lambda x: x[i], params[group]) if group == "blocks" else params[group]

        return cls(_abstract(params), layer)
