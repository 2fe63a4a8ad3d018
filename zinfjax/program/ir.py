"""The parts a program is made of: streams, leaves, groups and stages, and a leaf's store slices.

`zinfjax.program.split` cuts a loss function into a `Program` of these; `zinfjax.program.nested`
cuts a scan's body again where it scans over tiles.

Example:
    >>> Stream(4, tiles=2).slice_shape((2, 2, 8, 3))     # two layers of two tiles each
    (8, 3)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.errors import UserError

DOCS = "docs/models.md"


class ProgramError(UserError):
    """The loss function cannot be streamed as it is written."""


class NoScan(ProgramError):
    """No scan takes the parameters: there are no layers (or tiles) to stream."""


@dataclasses.dataclass(frozen=True)
class Stream:
    """How a parameter leaf is cut into the slices a scan reads, one per iteration.

    ``rows == 0``: a stacked leaf ``(length, ...)``, slice ``i`` is ``leaf[i]``.
    ``rows > 0``: row chunks, ``leaf`` padded with ``pad`` zero rows and reshaped to
    ``(length, rows, ...)``; slice ``i`` is rows ``i*rows .. (i+1)*rows``.
    ``tiles > 0``: the tiles of a scan nested in the scan over layers (`zinfjax.program.nested`);
    slice ``i`` is tile ``i % tiles`` of layer ``i // tiles``. With ``axis`` None the leaf stacks
    them, ``(layers, tiles, ...)``; with ``axis = a`` each tile is a block of axis ``a`` of the
    layer (the leaf keeps the layer's own shape, and the model cuts it into tiles: a view).

    Example:
        >>> Stream(29, rows=1733).slice_shape((50257, 768))
        (1733, 768)
        >>> Stream(8, tiles=4, axis=1).slice_shape((2, 768, 3072))     # 4 column blocks of each layer
        (768, 768)
    """

    length: int
    rows: int = 0
    pad: int = 0
    tiles: int = 0
    axis: int | None = None

    def slice_shape(self, shape) -> tuple[int, ...]:
        shape = tuple(int(d) for d in shape)
        if self.tiles and self.axis is not None:
            layer = list(shape[1:])
            layer[self.axis] //= self.tiles
            return tuple(layer)
        if self.tiles:
            return shape[2:]
        return shape[1:] if self.rows == 0 else (self.rows, *shape[1:])

    def tile(self, layer, t: int):
        """Tile ``t`` of one layer's slice of the leaf (``layer[t]`` when stacked)."""
        if self.axis is None:
            return layer[t]
        size = layer.shape[self.axis] // self.tiles
        return layer[(slice(None),) * self.axis + (slice(t * size, (t + 1) * size),)]

    def valid_rows(self, i: int, leaf_rows: int) -> int:
        """Rows of slice ``i`` that belong to the leaf (the last chunk may be part padding)."""
        return self.rows if self.rows == 0 else min(self.rows, leaf_rows - i * self.rows)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter leaf of the user's tree.

    Attributes:
        index: its position among the flattened parameters.
        path: its key path, ``a/b/c``.
        shape, dtype: as the loss function sees it.
        group: the store group it lives in (see `Group`).
        stream: how it is cut into slices, or None when it is read whole.
    """

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    group: str
    stream: Stream | None
    keys: tuple = ()  # the key path as plain keys (str, or int for a sequence index)

    @property
    def slice_shape(self) -> tuple[int, ...]:
        return self.shape if self.stream is None else self.stream.slice_shape(self.shape)

    @property
    def opt_shape(self) -> tuple[int, ...]:
        """The shape the optimizer sees: a tiled leaf's layer and tile axes merged into one streamed axis."""
        return (self.stream.length, *self.slice_shape) if self.stream and self.stream.tiles else self.shape


@dataclasses.dataclass(frozen=True)
class Group:
    """Parameters stored, read and updated together: a scan's streamed leaves, or a stage's whole leaves.

    A streamed group has ``length`` slices (layers or row chunks); a whole group has one. A leaf
    belongs to the group of the first stage (in forward order) that uses it, which is the last
    stage of the backward pass: its gradient is complete there.
    """

    name: str
    position: int
    leaves: tuple[int, ...]
    length: int
    sub: int | None = None  # in a nested scan (`zinfjax.program.nested`): the body's stage that owns it

    @property
    def streamed(self) -> bool:
        return self.name.startswith("s:")


@dataclasses.dataclass(eq=False)
class Whole:
    """A stretch of eqns between scans, run once per micro-batch."""

    position: int
    eqns: list
    params: list[int]  # leaves it reads whole
    inputs: list  # non-parameter variables it reads from outside (batch, rng, residuals)
    outputs: list  # variables it defines that later stages read
    kind: str = "whole"


class Output(NamedTuple):
    """One output of a scan: the variable later stages read it by, and the shape and dtype of its values as
    the program computes them (one micro-batch; a ``ys`` output stacked over the iterations).

    A ``dropped`` output is one the program never reads: its ``var`` is a placeholder no stage names, kept
    so that the engine can still hold the value (a dropped carry's cotangent is zeros of its value).
    """

    var: object
    like: jax.ShapeDtypeStruct
    dropped: bool = False


@dataclasses.dataclass(frozen=True)
class Loop:
    """A scan's loop as the engine runs it: read once from its equation when the program is cut
    (`zinfjax.program.split`), so the engine never reads the equation itself.

    Its operands are ``num_consts`` consts, then ``num_carry`` carries, then the per-iteration ``xs``; its
    outputs are the final ``carry`` (one `Output` per carry, whose ``like`` is also the type of the carry
    entering each iteration), then the ``ys`` stacked over the ``length`` iterations.

    Example:
        >>> Loop(4, reverse=True, num_consts=0, num_carry=1, carry=(), ys=()).order()
        [3, 2, 1, 0]
    """

    length: int
    reverse: bool
    num_consts: int
    num_carry: int
    carry: tuple[Output, ...]
    ys: tuple[Output, ...]

    def order(self) -> list[int]:
        """The iterations in the order the scan runs them."""
        return list(reversed(range(self.length))) if self.reverse else list(range(self.length))


@dataclasses.dataclass(eq=False)
class Scan:
    """A streamed scan: one iteration per slice of its streamed leaves.

    ``operands`` describes the body's inputs in order (consts, carry, xs), each one of
    ``("param", leaf)`` a whole leaf, ``("stream", leaf)`` a leaf's slice, ``("var", v)`` a
    residual (a per-iteration ``xs`` residual has the iteration axis after the micro-batch
    axis), or ``("literal", value)``. ``loop`` is what the engine reads of the scan's equation;
    ``eqn`` itself is for `zinfjax.program` alone (its stage functions run the body).
    """

    position: int
    eqn: object
    loop: Loop
    operands: list
    params: list[int]  # whole leaves it reads (flax variable_broadcast)
    streams: list[int]  # leaves it reads one slice at a time
    inputs: list  # residual variables it reads
    outputs: list  # its outputs that later stages read: final carry, stacked ys
    kind: str = "scan"
    body: object = None  # a `zinfjax.program.nested.Body` when its body scans over tiles

    @property
    def length(self) -> int:
        return self.loop.length

    @property
    def reverse(self) -> bool:
        return self.loop.reverse

    @property
    def num_consts(self) -> int:
        return self.loop.num_consts

    @property
    def num_carry(self) -> int:
        return self.loop.num_carry

    def order(self) -> list[int]:
        """The slices in the order the forward pass reads them."""
        return self.loop.order()

    def _vars_in(self, lo: int, hi: int) -> list:
        return [what for kind, what in self.operands[lo:hi] if kind == "var"]

    @property
    def const_vars(self) -> list:
        """Residuals the body reads every iteration (masks, positions, an encoder's output)."""
        return self._vars_in(0, self.num_consts)

    @property
    def carry_init(self) -> list:
        """The carry's initial operands: ``(kind, what)`` pairs."""
        return self.operands[self.num_consts : self.num_consts + self.num_carry]

    @property
    def xs_vars(self) -> list:
        """Residuals stacked over iterations (per-layer dropout keys); slice ``i`` feeds iteration ``i``."""
        return self._vars_in(self.num_consts + self.num_carry, len(self.operands))


@dataclasses.dataclass(eq=False)
class Program:
    """A loss function as stages over parameter groups (see the module docstring)."""

    closed: object  # the inlined closed jaxpr
    leaves: list[Leaf]
    groups: dict[str, Group]
    stages: list
    param_vars: list
    batch_vars: list
    rng_var: object
    loss_var: object
    params_tree: object
    batch_tree: object
    batch_like: list  # one micro-batch's leaves, as ShapeDtypeStruct

    @property
    def constants(self) -> dict:
        """The jaxpr's constants: available to every stage."""
        return dict(zip(self.closed.jaxpr.constvars, self.closed.consts, strict=True))

    def leaves_of(self, group: str) -> list[Leaf]:
        return [self.leaves[k] for k in self.groups[group].leaves]

    def scans(self) -> list[Scan]:
        return [s for s in self.stages if s.kind == "scan"]

    def streamed_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if g.streamed]


def store_slice(leaf, x, i: int):
    """Slice ``i`` of leaf ``x`` as a store holds it: a layer, a row chunk padded to its rows, or the whole leaf.

    Example (a table of 10 rows in 3 chunks of 4, padded to 12: the last chunk holds 2 rows and 2 of zeros):
        >>> leaf = Leaf(0, "embed/table", (10, 4), np.dtype("float32"), "s:embed", Stream(3, rows=4, pad=2))
        >>> store_slice(leaf, np.ones((10, 4)), 2).sum(axis=1).tolist()
        [4.0, 4.0, 0.0, 0.0]
    """
    stream = leaf.stream
    if stream is None:
        return x
    if stream.tiles:
        return stream.tile(x[i // stream.tiles], i % stream.tiles)
    if stream.rows == 0:
        return x[i]
    chunk = x[i * stream.rows : (i + 1) * stream.rows]
    pad = stream.rows - chunk.shape[0]
    if pad:
        chunk = jnp.pad(jnp.asarray(chunk), [(0, pad)] + [(0, 0)] * (np.ndim(x) - 1))
    return chunk


def unslice(leaf, slices: list):
    """A whole leaf from its store slices (the inverse of `store_slice`)."""
    stream = leaf.stream
    if stream is None:
        (x,) = slices
        return x
    if stream.tiles and stream.axis is not None:
        t = stream.tiles
        return jnp.stack([jnp.concatenate(slices[i : i + t], axis=stream.axis) for i in range(0, len(slices), t)])
    if stream.tiles:
        return jnp.stack(slices).reshape(leaf.shape)
    if stream.rows == 0:
        return jnp.stack(slices)
    return jnp.concatenate(slices)[: leaf.shape[0]]
