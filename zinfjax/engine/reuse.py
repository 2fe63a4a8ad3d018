"""Parameters kept from the forward for the backward: the layers whose next use is near are not read twice.

A streamed layer's parameters are read for its forward and again for its backward. The last layers
of the forward are the first of the backward, so little is read between their two uses (their *reuse
distance*): keeping them in memory saves their second read at a cost of their bytes until then.
DeepSpeed's ZeRO-3 does the same (``stage3_max_reuse_distance``).

`candidates` lists every scan iteration with its reuse distance (the parameters read between its two
uses: twice those the forward reads after it) and its bytes; `choose` takes those within
``max_reuse_distance``. `Held` hands the kept trees to the backward's reads.

Unset, ``max_reuse_distance`` keeps only what costs no memory the step does not take anyway
(`within`): the nearest iterations whose bytes fit beside every operation between their two uses in
what the step's largest operation holds. In gpt2-small that is the tied head's vocabulary chunks
(and in fp32 the last block): 0.18 GB fewer NVMe reads a step in fp32, 0.08 GB in bf16, at the same
peak. `handed_over` applies the same rule across the step's end: the last layers the backward updates
are the first the next forward reads (gpt2-small: the embedding's chunks and the first block), so
their updates hand the new compute copies straight to it. Keeping every layer
(``max_reuse_distance=1000000000``) saves 28% of the reads for 0.3 GB more peak memory
(docs/BENCHMARKS.md, "Reuse").

Example:
    >>> held = Held()
    >>> held.keep((3, 0), ["tree"])
    >>> slot = held.slot((3, 0), 0)
    >>> slot.read(0).result(), held.has((3, 0))
    ('tree', False)
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import numpy as np


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A scan iteration whose parameters could be kept: ``key`` is ``(scan position, iteration)``."""

    key: tuple[int, int]
    distance: int  # parameters read between its forward and its backward
    nbytes: int  # what keeping it holds


def _group_sizes(specs) -> dict[str, tuple[int, int]]:
    """``{group: (parameters, bytes)}`` of one slice of each group's compute copy."""
    out = {}
    for spec in specs:
        if spec.kind == "params":
            out[spec.group] = (sum(int(np.prod(x.shape[1:])) for x in spec.like.values()),
                               sum(int(np.prod(x.shape[1:])) * x.dtype.itemsize for x in spec.like.values()))
    return out


def candidates(program, specs) -> list[Candidate]:
    """Every scan iteration, nearest reuse first."""
    sizes = _group_sizes(specs)
    reads = []  # (key or None, parameters, bytes) in forward order
    for stage in program.stages:
        if stage.kind == "scan":
            groups = sorted({program.leaves[k].group for k in stage.streams})
            per = [(sizes[g][0] * _per_layer(program, g), sizes[g][1]) for g in groups if g in sizes]
            key = (lambda i: None) if stage.body is not None else (lambda i, p=stage.position: (p, i))  # noqa: E731
            for i in stage.order():  # a layer of tiles is never kept whole (`zinfjax.engine._nested`)
                reads.append((key(i), sum(n for n, _ in per), sum(b for _, b in per)))
        else:
            groups = sorted({program.leaves[k].group for k in stage.params})
            reads.append((None, sum(sizes[g][0] for g in groups if g in sizes), 0))
    out, after = [], 0
    for key, n, nbytes in reversed(reads):
        if key is not None:
            out.append(Candidate(key, 2 * after, nbytes))
        after += n
    return sorted(out, key=lambda c: c.distance)


def _per_layer(program, group: str) -> int:
    """The units of ``group`` one scan iteration reads: its tiles (`zinfjax.program.nested`), else one."""
    leaf = program.leaves[program.groups[group].leaves[0]]
    return (leaf.stream.tiles or 1) if leaf.stream is not None else 1


def choose(found: list[Candidate], limit: int | None) -> list[Candidate]:
    """The candidates with fewer than ``limit`` parameters of reuse distance (none when unset or 0)."""
    return [c for c in found if limit is not None and c.distance < limit]


STATE_KINDS = ("master", "opt", "grads")  # what an update reads beside the parameters


def timeline(program, slice_bytes: dict) -> list[tuple[tuple[int, int] | None, int]]:
    """A step's operations in order, each as ``(scan iteration or None, bytes it reads)``: the forward's,
    then the backward's, which reads each unit's parameters again and, for the units it completes, their
    optimizer state. ``slice_bytes`` is ``{(kind, group): bytes of one slice}``."""

    def reads(groups, kinds) -> int:
        return sum(slice_bytes.get((kind, g), 0) * _per_layer(program, g) for g in groups for kind in kinds)

    forward, backward = [], []
    for stage in program.stages:
        if stage.kind == "scan":
            groups = sorted({program.leaves[k].group for k in stage.streams})
            owned = [g for g in groups if program.groups[g].position == stage.position]
            nested = stage.body is not None  # a layer of tiles: read tile by tile, never a candidate
            for i in stage.order():
                key = None if nested else (stage.position, i)
                forward.append((key, reads(groups, ["params"])))
                backward.append((key, reads(groups, ["params"]) + reads(owned, STATE_KINDS)))
        else:
            groups = sorted({program.leaves[k].group for k in stage.params})
            forward.append((None, reads(groups, ["params"])))
            backward.append((None, reads(groups, ["params", *STATE_KINDS])))
    return forward + backward[::-1]


def within(found: list[Candidate], steps: list, per_read: int, eligible) -> list[Candidate]:
    """The candidates kept when ``max_reuse_distance`` is unset: nearest first, those whose bytes, with what
    is kept already, fit beside every operation between their two uses (``steps``: `timeline`) in the
    memory the largest operation takes, an operation of ``r`` bytes of reads taking ``per_read * r``
    (`zinfjax.engine.budget.LIVE_BASE`). ``eligible(key)``: whether keeping it saves a read at all.

    The kept bytes never exceed what the step's largest operation holds anyway, whatever the layers
    and the vocabulary (invariant 2, docs/design.md): in gpt2-small, the tied head's vocabulary chunks,
    read for the head's forward and again at once for its backward.

    Example:
        >>> steps = [(None, 0), ((1, 0), 5), ((1, 1), 5), ((1, 1), 5), ((1, 0), 5), (None, 9)]
        >>> found = [Candidate((1, 1), 0, 4), Candidate((1, 0), 2, 4)]
        >>> [c.key for c in within(found, steps, per_read=4, eligible=lambda key: True)]
        [(1, 1), (1, 0)]
        >>> [c.key for c in within(found, steps[:-1] + [(None, 5)], per_read=4, eligible=lambda key: True)]
        [(1, 1)]
    """
    uses: dict = {}
    for n, (key, _) in enumerate(steps):
        if key is not None:
            uses.setdefault(key, []).append(n)
    live = per_read * max((r for _, r in steps), default=0)
    held = [0] * len(steps)
    kept = []
    for c in found:
        if not eligible(c.key):
            continue
        first, last = uses[c.key][0], uses[c.key][-1]
        between = range(first + 1, last)
        if all(per_read * steps[n][1] + held[n] + c.nbytes <= live for n in between):
            for n in between:
                held[n] += c.nbytes
            kept.append(c)
    return kept


def handed_over(program, slice_bytes: dict, per_read: int, eligible) -> list[Candidate]:
    """The scan iterations whose update hands its new compute copy straight to the next step's forward, which
    then reads nothing: the backward updates the first layers last, and the forward reads them first.

    ``slice_bytes`` as for `timeline`; kept as `within` keeps, across the step's end: each candidate's
    two uses are its update in one step's backward and its read in the next step's forward. Only scans
    that update what they stream are candidates (in gpt2-small the embedding's vocabulary chunks, whose
    forward is their first use, and the blocks).

    Example:
        >>> forward = [((1, 0), 5), ((3, 0), 20), ((3, 1), 20)]  # an embedding, then two blocks
        >>> backward = [((3, 1), 40), ((3, 0), 40), ((1, 0), 9)]
        >>> sizes = {(1, 0): 4, (3, 0): 8, (3, 1): 8}
        >>> [c.key for c in across(forward + backward, sizes, per_read=4, eligible=lambda key: True)]
        [(1, 0), (3, 0)]
    """
    sizes = {}
    for stage in program.stages:
        if stage.kind == "scan" and stage.body is None:
            groups = {program.leaves[k].group for k in stage.streams}
            if groups and all(program.groups[g].position == stage.position for g in groups):
                for i in stage.order():
                    sizes[(stage.position, i)] = sum(slice_bytes.get(("params", g), 0) for g in groups)
    return across(timeline(program, slice_bytes), sizes, per_read, eligible)


def across(steps: list, sizes: dict, per_read: int, eligible) -> list[Candidate]:
    """`within` over a step's backward followed by the next step's forward (``steps``: a `timeline`), for the
    iterations in ``sizes`` (``{key: bytes}``), nearest first."""
    half = len(steps) // 2
    turned = steps[half:] + steps[:half]
    uses: dict = {}
    for n, (key, _) in enumerate(turned):
        if key in sizes:
            uses.setdefault(key, []).append(n)
    found = sorted((Candidate(k, n[-1] - n[0], sizes[k]) for k, n in uses.items()), key=lambda c: c.distance)
    return within(found, turned, per_read, eligible)


class Held:
    """The parameter trees the forward kept, by ``(scan position, iteration)``, until the backward reads them."""

    def __init__(self):
        self._trees: dict[tuple, list] = {}

    def keep(self, key: tuple, trees: list) -> None:
        self._trees[key] = list(trees)

    def has(self, key: tuple) -> bool:
        return key in self._trees

    def slot(self, key: tuple, k: int) -> _Slot:
        """A store-like source of the ``k``-th tree kept under ``key``, for a `Read`."""
        return _Slot(self, key, k)

    def take(self, key: tuple, k: int):
        trees = self._trees[key]
        tree, trees[k] = trees[k], None
        if all(t is None for t in trees):
            del self._trees[key]
        return tree


class _Slot:
    """What a `Read` of a kept tree reads: no tier, no I/O; the tree is there."""

    tier = None

    def __init__(self, held: Held, key: tuple, k: int):
        self.held, self.key, self.k = held, key, k

    def part_nbytes(self, keys=None) -> int:
        """Bytes a read adds to memory: none, the tree is held already."""
        return 0

    def read(self, layer: int, keys=None, memory_kind: str = "device") -> Future:
        future: Future = Future()
        future.set_result(self.held.take(self.key, self.k))
        return future
