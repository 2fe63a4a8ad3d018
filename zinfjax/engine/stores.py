"""The stores a wrapped state lives in: one per (kind, group), each on the tier its tier key gives (`Tiering`).

Kinds: ``params`` (the compute copy), ``master`` (fp32 master weights, under mixed precision),
``opt`` (the optimizer state leaves that belong to the group's parameters), ``grads`` (gradients
spooled for a later sweep, or waiting for a tied parameter's other contributions) and ``acts``
(one per streamed scan: the carry entering each iteration, the layer-boundary activation
checkpoint). A streamed group's store has one "layer" per slice (a layer, or a row chunk); a whole
group's has one.

Every leaf carries its kind's sharding at the run's ZeRO stage (`Placement`), so a tier holds, reads
and writes each device's own shard of each slice.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax._util.byte_sizes import format_bytes
from zinfjax._util.choices import TIER_KEYS
from zinfjax._util.tier_split import TierSplit
from zinfjax.engine.placement import Placement
from zinfjax.errors import ConfigError
from zinfjax.program.optimizer import UpdatePlan
from zinfjax.program.split import Program
from zinfjax.sections import Numerics, Tiering
from zinfjax.store import BufferPool, LayerStore, open_store, staging_bytes
from zinfjax.store.base import close_all
from zinfjax.store.disk import check_free_space, prepare_directory
from zinfjax.store.errors import BufferBudgetError
from zinfjax.store.pool import staging_pool
from zinfjax.store.split import pieces_of

# The engine's nvme stores hold its working state, which a crash mid-step leaves inconsistent
# across layers whatever each chunk does; durable copies are checkpoints. So chunks are
# overwritten in place, without fsync: no inode made and freed per chunk, no flush to wait for.
# The checksum still catches a chunk torn by a crash.
# A store left by a run of another model or split is replaced: the engine writes all of it before reading any.
SCRATCH_NVME = {"atomic": False, "file_io_sync": False, "replace": True}
KINDS = ("params", "master", "opt", "grads")


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """One store before it is opened: kind, group, tier, and its abstract tree ``{path: stacked leaf}``."""

    kind: str
    group: str
    tier: str
    like: dict

    @property
    def name(self) -> str:
        """The store's directory under ``nvme_path``."""
        return f"{self.kind}_{dir_name(self.group)}"

    @property
    def length(self) -> int:
        """The store's slices."""
        return next(iter(self.like.values())).shape[0] if self.like else 0

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers its slices are on (`zinfjax._util.tier_split`)."""
        return tuple(t for t, _, _ in TierSplit.parse(self.tier).ranges(self.length))

    def bytes_on(self, tiers) -> int:
        """Bytes of its slices that the tiers ``tiers`` hold."""
        per_slice = slice_bytes(self)
        return sum((b - a) * per_slice for t, a, b in TierSplit.parse(self.tier).ranges(self.length) if t in tiers)


def dir_name(group: str) -> str:
    """A filesystem-safe name for a group (``s:blocks`` -> ``blocks``)."""
    kind, _, rest = group.partition(":")
    return re.sub(r"[^A-Za-z0-9_.\-@]", "_", rest or kind).replace("@", "-at")


@dataclasses.dataclass
class EngineStores:
    """Every store of one wrapped state: ``stores[kind][group]``, and ``acts[scan position]``."""

    stores: dict[str, dict[str, LayerStore]]
    acts: dict[int, LayerStore]
    pool: BufferPool

    def kind(self, kind: str) -> dict[str, LayerStore]:
        return self.stores.get(kind, {})

    @property
    def params(self) -> dict[str, LayerStore]:
        return self.kind("params")

    @property
    def master(self) -> dict[str, LayerStore] | None:
        return self.stores.get("master")

    @property
    def opt(self) -> dict[str, LayerStore]:
        return self.kind("opt")

    @property
    def grads(self) -> dict[str, LayerStore]:
        return self.kind("grads")

    def all(self) -> list[LayerStore]:
        return [s for kind in self.stores.values() for s in kind.values()] + list(self.acts.values())

    def pieces(self) -> list[LayerStore]:
        """Every store of one tier: the stores, each split one (`zinfjax.store.split`) as its pieces."""
        return [piece for store in self.all() for _, piece in pieces_of(store)]

    def flush(self) -> None:
        for store in self.all():
            store.flush()

    def close(self) -> None:
        close_all(self.all())


def stacked(length: int, slice_shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((length, *slice_shape), dtype, sharding=sharding)


def plan_stores(tiering: Tiering, program, plan, placement, compute_dtype, spooled: set[str],
                masterless: frozenset = frozenset()) -> list[StoreSpec]:
    """Every store as a `StoreSpec`, before anything is opened.

    ``spooled`` names the groups that need a gradient store; ``masterless`` the frozen leaves that keep no fp32
    master under mixed precision (`masterless`). A tensor-parallel split that does not divide is refused here,
    before any store is opened.
    """
    mixed = compute_dtype != jnp.float32
    specs = []
    for g in program.groups.values():
        leaves = program.leaves_of(g.name)

        def tree(kind, dtype=None, leaves=leaves, g=g):
            return {leaf.path: stacked(g.length, leaf.slice_shape, dtype or leaf.dtype,
                                       placement.stacked(kind, leaf.path, leaf.slice_shape)) for leaf in leaves}

        specs.append(StoreSpec("params", g.name, tiering.params, tree("params", compute_dtype)))
        kept = [leaf for leaf in leaves if leaf.index not in masterless]
        if mixed and kept:
            specs.append(StoreSpec("master", g.name, tiering.optimizer, tree("master", jnp.float32, kept)))
        if g.name in spooled:
            specs.append(StoreSpec("grads", g.name, tiering.gradients, tree("grads", jnp.float32)))
        state = plan.state_of(g.name)
        if state:
            like = {}
            for s in state:
                shape = state_slice_shape(program, s)
                like[s.path] = stacked(g.length, shape, s.dtype, placement.stacked("opt", s.path, shape))
            specs.append(StoreSpec("opt", g.name, tiering.optimizer, like))
    return specs


def state_slice_shape(program, s) -> tuple[int, ...]:
    """The shape of one slice of state leaf ``s``: cut like the parameter it belongs to."""
    leaf = program.leaves[s.param]
    if leaf.stream is None:
        return s.shape
    if leaf.stream.tiles:  # the optimizer sees a tiled leaf with its layer and tile axes merged (`Leaf.opt_shape`)
        return s.shape[1:]
    return leaf.stream.slice_shape(s.shape)


def acts_spec(tiering: Tiering, scan, placement, grad_accum: int) -> StoreSpec:
    """The activation checkpoints of one streamed scan: the carry entering each iteration."""
    like = {}
    for j, carry in enumerate(scan.loop.carry):  # the carry entering an iteration is of the final carry's type
        shape = (grad_accum, *carry.like.shape)
        sharding = placement.rows_sharding((scan.length, *shape), lead=2)
        like[f"carry{j}"] = jax.ShapeDtypeStruct((scan.length, *shape), carry.like.dtype, sharding=sharding)
    return StoreSpec("acts", f"s:scan{scan.position}", tiering.activations, like)


def slice_bytes(spec: StoreSpec) -> int:
    """Bytes of one slice of a store (every leaf, every shard)."""
    return sum(leaf_slice_bytes(spec, path) for path in spec.like)


def leaf_slice_bytes(spec: StoreSpec, path: str) -> int:
    """Bytes of one slice of the leaf ``path`` of a store."""
    x = spec.like[path]
    return int(np.prod(x.shape[1:])) * jnp.dtype(x.dtype).itemsize


def budget_needs(specs: list[StoreSpec], acts: list[StoreSpec], platform: str,
                 parts: dict | None = None, alone: frozenset = frozenset()) -> tuple[int, int, int]:
    """``(read, write, resident)`` bytes for the memory budget: the largest operation's reads (a group's
    slices of every kind and an activation), the largest slice staged for a write, and the state held
    whole in host memory (the host tier, and the device tier where the device is the host).

    ``parts`` (`zinfjax.engine.parts.update_parts`: `Part` lists by group) are the groups updated a
    part at a time: their backward reads the compute copy (and spooled gradients), each part its
    leaves' master and state, and writes stage one part at a time. ``alone`` (`written_alone`): leaves whose
    writes stage one at a time.
    """
    parts = parts or {}
    per_group: dict[str, int] = {}
    for spec in specs:
        if spec.group not in parts or spec.kind in ("params", "grads"):
            per_group[spec.group] = per_group.get(spec.group, 0) + slice_bytes(spec)
    for group, cut in parts.items():
        by_kind = {s.kind: s for s in specs if s.group == group and s.kind in ("master", "opt")}
        for part in cut:
            got = sum(leaf_slice_bytes(s, k) for s in by_kind.values() for k in part.keys(s.kind))
            per_group[group] = max(per_group[group], got)
    read = max(per_group.values(), default=0) + max((slice_bytes(a) for a in acts), default=0)
    write = largest_staged(specs + acts, parts, alone)
    in_memory = ("host", "device") if platform == "cpu" else ("host",)
    resident = sum(s.bytes_on(in_memory) for s in specs + acts)
    return read, write, resident


def staged(spec: StoreSpec, parts: dict, alone: frozenset = frozenset()) -> list[dict]:
    """What one read or write of ``spec``'s store stages at most: a whole slice, or for the master and
    state of a group updated in parts, each part (its compute copy is still read whole); each leaf of
    ``alone`` by itself (`written_alone`), and then the compute copy's writes by part too."""
    solo = [{k: x} for k, x in spec.like.items() if k in alone]
    rest = {k: x for k, x in spec.like.items() if k not in alone}
    by_part = spec.group in parts and (spec.kind in ("master", "opt") or (solo and spec.kind == "params"))
    cut = [{k: rest[k] for k in part.keys(spec.kind) if k in rest} for part in parts[spec.group]] if by_part else [rest]
    return [c for c in cut if c] + solo


def largest_staged(specs: list[StoreSpec], parts: dict, alone: frozenset = frozenset()) -> int:
    """The host buffer bytes the largest read or write of the nvme stores stages."""
    return max((staging_bytes(like) for s in specs if "nvme" in s.tiers
                for like in staged(s, parts, alone)), default=0)


def written_alone(program: Program, plan: UpdatePlan, spooled: bool, platform: str) -> frozenset[str]:
    """The leaves (paths) whose store traffic stages one leaf at a time: on the CPU, where reads stage nothing
    (they land in arrays of their own), the frozen leaves no update writes (`masterless`), which the initial
    fill writes one by one (`zinfjax.engine.parts.fill_parts`)."""
    if platform != "cpu":
        return frozenset()
    return frozenset(program.leaves[k].path for k in masterless(program, plan, spooled))



def preflight(nvme_path: str | None, host_buffer_bytes: int, specs: list[StoreSpec], parts: dict | None = None,
              in_place: dict | None = None, alone: frozenset = frozenset()) -> None:
    """Before anything is written: ``nvme_path`` is writable, can hold the state (but the leaves read ``in_place``),
    and one slice fits the ``host_buffer_bytes`` of buffers."""
    if not any("nvme" in s.tiers for s in specs):
        return
    layer = largest_staged(specs, parts or {}, alone)
    if layer > host_buffer_bytes:
        raise BufferBudgetError(
            f"host_buffer_bytes={host_buffer_bytes} cannot hold one layer: the largest layer needs "
            f"{layer} bytes; raise host_buffer_bytes to at least {layer}"
        )
    prepare_directory(nvme_path)
    kept = in_place or {}
    written = [dataclasses.replace(s, like={p: x for p, x in s.like.items()
                                            if not (s.kind == "params" and p in kept.get(s.group, {}))})
               for s in specs if "nvme" in s.tiers]
    check_free_space(nvme_path, sum(s.bytes_on(("nvme",)) for s in written if s.like))


def build_stores(tiering: Tiering, host_buffer_bytes: int, specs: list[StoreSpec], acts: dict[int, StoreSpec],
                 parts: dict | None = None, host_kind: str | None = None,
                 in_place: dict | None = None, alone: frozenset = frozenset(), reuse_reads: bool = True
                 ) -> EngineStores:
    """Checks the specs against the disk and the buffer budget (``host_buffer_bytes``: the one the engine's budget
    settled, `zinfjax.engine.budget.Budget`), then opens every store (empty) under ``tiering.nvme_path``, the host
    tier's in its memory kind ``host_kind`` (default: `zinfjax.store.layout.host_tier_kind`), and the params
    leaves ``in_place`` names (``{group: {path: directory}}``, `zinfjax.engine.in_place`) where they are.
    ``reuse_reads``: the nvme tier reads into arrays of earlier reads that nothing holds (`zinfjax.store.recycle`)."""
    in_place = in_place or {}
    preflight(tiering.nvme_path, host_buffer_bytes, specs + list(acts.values()), parts, in_place, alone)
    pool = staging_pool(host_buffer_bytes)
    opened: dict[str, dict[str, LayerStore]] = {}

    def open_one(spec: StoreSpec) -> LayerStore:
        options = dict(SCRATCH_NVME, verify=tiering.verify_chunks, reuse_reads=reuse_reads)  # memory tiers take none
        if spec.kind == "params" and spec.group in in_place:
            options["in_place"] = in_place[spec.group]
        return open_store(spec.tier, spec.like, path=tiering.nvme_path, name=spec.name, pool=pool,
                          host_kind=host_kind, **options)

    out = EngineStores(opened, {}, pool)
    try:
        for spec in specs:
            opened.setdefault(spec.kind, {})[spec.group] = open_one(spec)
        for position, spec in acts.items():
            out.acts[position] = open_one(spec)
    except BaseException:
        out.close()
        raise
    return out


def spools_gradients(numerics: Numerics, plan: UpdatePlan) -> bool:
    """Whether a step spools every unit's gradient to the gradient tier and updates after the backward pass:
    the optimizer needs more than one sweep (per-tensor norms, a global norm), or fp16 checks every gradient
    for overflow first."""
    return plan.sweeps > 1 or numerics.precision == "fp16"


def updated_apart(program: Program, plan: UpdatePlan, group, spooled: bool) -> bool:
    """Whether ``group`` holds frozen leaves besides trainable ones and its fused update takes the trainable ones
    alone (`zinfjax.engine.parts.trainable_parts`): its frozen leaves are never read by an update nor written."""
    trainable = [k for k in group.leaves if k not in plan.frozen]
    return (not spooled and group.streamed and 0 < len(trainable) < len(group.leaves) and group.sub is None
            and plan.separable(group.name))


def masterless(program: Program, plan: UpdatePlan, spooled: bool) -> frozenset[int]:
    """The frozen leaves that keep no fp32 master under mixed precision: those no update reads, in wholly frozen
    groups and in groups updated apart (`updated_apart`). Their compute copy is all there is of them. (Where the
    gradients are spooled, a mixed group's sweep still reads every leaf's master.)"""
    return frozenset(k for g in program.groups.values()
                     if plan.frozen_group(g.name) or updated_apart(program, plan, g, spooled)
                     for k in g.leaves if k in plan.frozen)


def tied_groups(program: Program) -> dict[str, int]:
    """Streamed groups whose leaves other scans also stream: how many scans contribute to their gradients."""
    out: dict[str, int] = {}
    for scan in program.scans():
        for k in scan.streams:
            group = program.groups[program.leaves[k].group]
            if group.position != scan.position:
                out[group.name] = out.get(group.name, 0) + 1
    return out


def store_specs(tiering: Tiering, numerics: Numerics, program: Program, plan: UpdatePlan, placement: Placement,
                compute_dtype):
    """Every store of an engine before it opens them: the state's `StoreSpec` list and the activations' by scan."""
    spools = spools_gradients(numerics, plan)
    spooled = set(program.groups) if spools else set(tied_groups(program))
    specs = plan_stores(tiering, program, plan, placement, compute_dtype, spooled, masterless(program, plan, spools))
    acts = {s.position: acts_spec(tiering, s, placement, numerics.grad_accum) for s in program.scans()}
    check_splits(tiering, specs + list(acts.values()))
    return specs, acts


# Which tier key places each kind of store.
KIND_KEY = {"params": "params", "master": "optimizer", "opt": "optimizer", "grads": "gradients", "acts": "activations"}


def check_splits(tiering: Tiering, specs: list[StoreSpec]) -> None:
    """Refuses a split (``host:12,nvme``) that names more layers than the longest store of its part holds."""
    for key in TIER_KEYS:
        split = TierSplit.parse(getattr(tiering, key))
        longest = max((s.length for s in specs if KIND_KEY[s.kind] == key), default=0)
        if not split.whole and split.counted > longest:
            raise ConfigError(f"{key}={split} names {split.counted} layers, but the model's {key} stores have at most "
                              f"{longest}; name {longest} or fewer")


def split_advice(tiering: Tiering, specs: list[StoreSpec], short: int) -> str:
    """For a budget ``short`` bytes short of a step: how many fewer layers each split part (``host:12,nvme``) must
    hold in host memory for it to fit (with one to spare: the process's own memory moves a little), or ``""``.

    Example (an optimizer state of 36 layers of 4 MiB, 12 of them in host memory, and a budget 10 MiB short):
        >>> like = {"blocks/w": stacked(36, (1 << 20,), jnp.float32, None)}
        >>> spec = StoreSpec("opt", "s:blocks", "host:12,nvme", like)
        >>> split_advice(Tiering(optimizer="host:12,nvme", nvme_path="/tmp/x"), [spec], 10 << 20)
        'optimizer=host:12,nvme holds 48.0 MiB in host memory; optimizer=host:8,nvme (4 fewer layers of 4.0 MiB) fits'
    """
    tips = []
    for key in TIER_KEYS:
        split = TierSplit.parse(getattr(tiering, key))
        streamed = [s for s in specs if KIND_KEY[s.kind] == key and s.length > 1]
        if split.whole or not streamed or short <= 0:
            continue
        length, per_layer = max(s.length for s in streamed), sum(slice_bytes(s) for s in streamed)
        held = sum(b - a for t, a, b in split.ranges(length) if t == "host")
        fewer = -(-short // per_layer) + 1
        kept = held - fewer
        if kept <= 0:
            tips.append(f"{key}=nvme frees the {format_bytes(held * per_layer)} {key}={split} holds in host memory, "
                        "not enough alone")
            continue
        new = f"host:{kept},nvme" if split.tiers[0] == "host" else f"nvme:{length - kept},host"
        tips.append(f"{key}={split} holds {format_bytes(held * per_layer)} in host memory; {key}={new} "
                    f"({fewer} fewer layers of {format_bytes(per_layer)}) fits")
    return " or ".join(tips)
