"""Parameters kept from the forward for the backward: the layers whose next use is near are not read twice.

A streamed layer's parameters are read for its forward and again for its backward. The last layers
of the forward are the first of the backward, so little is read between their two uses (their *reuse
distance*): keeping them in memory saves their second read at a cost of their bytes until then.
DeepSpeed's ZeRO-3 does the same (``stage3_max_reuse_distance``).

`candidates` lists every scan iteration with its reuse distance (the parameters read between its two
uses: twice those the forward reads after it) and its bytes; `choose` takes those within
``max_reuse_distance``. `Held` hands the kept trees to the backward's reads.

It is off unless asked for. Keeping every layer of gpt2-small saves 28% of its NVMe reads for 0.3 GB
more peak memory; what that buys depends on what paces the step: 3% (fp32; bf16: none) where the
step is CPU-bound, 4-9% (fp32) on a machine with twice the compute, where it sits near the disk's
floor (docs/BENCHMARKS.md, "Reuse").

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
            per = [sizes[g] for g in groups if g in sizes]
            for i in stage.order():
                reads.append(((stage.position, i), sum(n for n, _ in per), sum(b for _, b in per)))
        else:
            groups = sorted({program.leaves[k].group for k in stage.params})
            reads.append((None, sum(sizes[g][0] for g in groups if g in sizes), 0))
    out, after = [], 0
    for key, n, nbytes in reversed(reads):
        if key is not None:
            out.append(Candidate(key, 2 * after, nbytes))
        after += n
    return sorted(out, key=lambda c: c.distance)


def choose(found: list[Candidate], limit: int | None) -> list[Candidate]:
    """The candidates with fewer than ``limit`` parameters of reuse distance (none when unset or 0)."""
    return [c for c in found if limit is not None and c.distance < limit]


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
