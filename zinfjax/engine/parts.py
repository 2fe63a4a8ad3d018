"""Update parts: a layer's leaves cut so that its update reads a few leaves' state at a time.

A fused update reads a layer's optimizer state and fp32 master next to its parameters: for Adam in
bf16, 12 bytes per parameter against the backward's 2. With every tier on NVMe that read, with its
outputs, sets the memory a step needs (`zinfjax.engine.budget`). When the optimizer updates each
leaf from its own state alone (`UpdatePlan.separable`: Adam, SGD, Lion, ...), the engine can update
a streamed layer in *parts*: after the layer's backward, one operation per part reads, updates and
writes just those leaves' master and state. Leaves are packed in group order while a part's reads
stay within the larger of the backward's (the layer's compute copy) and the largest leaf's, or
within ``sub_group_size`` parameters when that is set. More operations cost CPU time (`bench step`
bf16 on NVMe, 2 cores: 3.4-3.9 s in parts against 3.2 s whole), so the engine cuts layers only when
the memory budget needs it or ``sub_group_size`` asks (`zinfjax.engine.engine.Engine`). Each leaf's
update is the same computation either way, compiled per part: equal to the last bit or so
(tests/engine/test_parts.py), and held to the in-memory reference like every path.

Example (MLP blocks of 16,384 + 256 + 16,384 + 64 parameters, packed in group order in parts of at most 20,000):
    >>> import jax, jax.numpy as jnp, optax
    >>> from zinfjax.engine.engine import prepare
    >>> from zinfjax.program import program_for
    >>> from zinfjax.sections import EngineSettings
    >>> from zinfjax.sharding import make_mesh
    >>> def loss_fn(params, x):                   # four blocks: fc (64 -> 256), proj (256 -> 64)
    ...     def layer(h, p):
    ...         up = jnp.tanh(h @ p["fc"]["kernel"] + p["fc"]["bias"][None])
    ...         return h + up @ p["proj"]["kernel"] + p["proj"]["bias"][None], None
    ...     return jnp.mean(jax.lax.scan(layer, x, params["blocks"])[0] ** 2)
    >>> params = {"blocks": {"fc": {"kernel": jnp.zeros((4, 64, 256)), "bias": jnp.zeros((4, 256))},
    ...                      "proj": {"kernel": jnp.zeros((4, 256, 64)), "bias": jnp.zeros((4, 64))}}}
    >>> program, tx = program_for(loss_fn, params, jnp.ones((8, 64))), optax.adam(1e-3)
    >>> ready = prepare(program, tx, EngineSettings(), make_mesh({"data": 1}))  # what an Engine settles first
    >>> parts = update_parts(program, ready.layout.plan, ready.specs, spooled=False, sub_group_size=20_000)
    >>> [[program.leaves[k].path for k in part.leaves] for part in parts["s:blocks"]]
    [['blocks/fc/bias', 'blocks/fc/kernel', 'blocks/proj/bias'], ['blocks/proj/kernel']]
"""

from __future__ import annotations

import dataclasses
import math

from zinfjax.engine.stores import StoreSpec, leaf_slice_bytes, slice_bytes, updated_apart


@dataclasses.dataclass(frozen=True)
class Part:
    """Some leaves of a group, updated together: their indices, parameter paths and state paths."""

    leaves: tuple[int, ...]
    params: tuple[str, ...]
    state: tuple[str, ...]

    def keys(self, kind: str) -> tuple[str, ...]:
        """The keys this part moves in a store of ``kind`` (params, master: parameter paths; opt: state)."""
        return self.state if kind == "opt" else self.params


def update_parts(program, plan, specs: list[StoreSpec], spooled: bool,
                 sub_group_size: int | None = None) -> dict[str, list[Part]]:
    """The groups whose update can be cut in parts, each with its parts in group order.

    ``sub_group_size`` packs at most that many parameters of a slice in a part; without it, a part
    reads at most what the larger of the layer's backward and its largest leaf's update reads (so
    the largest operation is no larger than it must be, in as few parts as that allows).
    ``spooled``: the gradients go to their tier and sweeps update from there, so no update is fused.
    """
    if spooled:
        return {}
    by_kind = {(s.kind, s.group): s for s in specs}
    out = {}
    for g in program.streamed_groups():
        if len(g.leaves) < 2 or g.sub is not None or not plan.separable(g.name):  # tiles are cut already
            continue
        trainable = _trainable(plan, g)  # a frozen leaf is in no part: never updated
        if not trainable:
            continue
        if sub_group_size:
            sizes = [(k, math.prod(program.leaves[k].slice_shape)) for k in trainable]
            target = sub_group_size
        else:
            sizes = [(k, _update_bytes(program, plan, by_kind, g.name, k)) for k in trainable]
            target = max(sum(slice_bytes(by_kind[kind, g.name]) for kind in ("params", "grads")
                             if (kind, g.name) in by_kind),
                         max(n for _, n in sizes))
        parts = [_part(program, plan, g.name, leaves) for leaves in _pack(sizes, target)]
        if len(parts) > 1 or len(trainable) < len(g.leaves):
            out[g.name] = parts
    return out


def trainable_parts(program, plan, spooled: bool) -> dict[str, list[Part]]:
    """The streamed groups that hold frozen leaves (`UpdatePlan.frozen`) besides trainable ones, each updated as one
    part of its trainable leaves: its frozen leaves are never updated nor written (where the update is fused)."""
    return {g.name: [_part(program, plan, g.name, _trainable(plan, g))] for g in program.streamed_groups()
            if updated_apart(program, plan, g, spooled)}


def _trainable(plan, group) -> tuple[int, ...]:
    return tuple(k for k in group.leaves if k not in plan.frozen)


def fill_parts(program, plan, parts: dict, group: str) -> list:
    """What the initial fill of ``group`` writes, part by part: its update parts, then each leaf in none (frozen
    ones, `trainable_parts`, which no update reads together) alone, as every leaf of a wholly frozen group; ``[None]``,
    the whole unit at once, for a group updated whole."""
    cut = parts.get(group) or []
    if not cut and not plan.frozen_group(group):
        return [None]
    covered = {k for p in cut for k in p.leaves}
    return cut + [_part(program, plan, group, (k,)) for k in program.groups[group].leaves if k not in covered]


def _part(program, plan, group: str, leaves: tuple[int, ...]) -> Part:
    return Part(leaves, tuple(program.leaves[k].path for k in leaves),
                tuple(s.path for s in plan.part_state(group, leaves)))


def _update_bytes(program, plan, by_kind: dict, group: str, k: int) -> int:
    """What the update of leaf ``k`` reads beyond the backward: its master and its optimizer state."""
    master, opt = by_kind.get(("master", group)), by_kind.get(("opt", group))
    out = leaf_slice_bytes(master, program.leaves[k].path) if master else 0
    return out + sum(leaf_slice_bytes(opt, s.path) for s in plan.part_state(group, (k,)))


def _pack(sizes: list[tuple[int, int]], target: int) -> list[tuple[int, ...]]:
    """Consecutive leaves packed while a part's bytes stay within ``target`` (a larger leaf alone).

    Example:
        >>> _pack([(0, 5), (1, 4), (2, 9), (3, 1)], target=10)
        [(0, 1), (2, 3)]
    """
    parts: list[list[int]] = []
    held = 0
    for k, nbytes in sizes:
        if not parts or held + nbytes > target:
            parts.append([])
            held = 0
        parts[-1].append(k)
        held += nbytes
    return [tuple(p) for p in parts]
