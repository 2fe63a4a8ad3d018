"""A streamed scan whose body scans again, over tiles: the body cut into the stages one layer runs.

A layer too large to hold at once is written as a scan over its tiles inside the scan over layers
(`zinfjax.models.tiled`'s ``TiledMLP`` and ``TiledDense``: an ``nn.scan`` inside the ``nn.scan`` of
the blocks), so its tile leaves are ``(layers, tiles, ...)``. The engine streams such a layer as it
streams the model: the outer scan's body is cut again, at its inner streamed scans, into whole
stretches and tile scans (a `Body`), and each leaf of the layer gets a group of its own kind:

- a tile leaf (an inner scan's ``xs``): a group of ``layers * tiles`` units, unit ``i * tiles + t``
  being tile ``t`` of layer ``i`` (`Stream` with ``tiles``), updated as soon as that tile's backward ran;
- every other leaf of the layer (norms, biases, matrices left whole): one group of ``layers`` units,
  read once per layer and updated once the layer's backward ran.

So one operation holds one tile (or the rest of one layer), never a whole layer. A tile leaf must be
used by its tile scan alone, and a nested scan's leaves by no other scan; anything else is refused by
name.

Example (two layers, each an MLP in 8 tiles of its hidden units, scanned, beside a matrix left whole):
    >>> import jax, jax.numpy as jnp
    >>> from zinfjax.program import program_for
    >>> def loss_fn(params, x):
    ...     def layer(h, p):
    ...         tile = lambda out, t: (out + jnp.tanh(h @ t["w_in"]) @ t["w_out"], None)
    ...         mlp, _ = jax.lax.scan(tile, jnp.zeros_like(h), p["tiles"])
    ...         return jnp.tanh(h @ p["w"]) + mlp, None
    ...     return jnp.mean(jax.lax.scan(layer, x, params["blocks"])[0] ** 2)
    >>> tiles = {"w_in": jnp.ones((2, 8, 16, 4)), "w_out": jnp.ones((2, 8, 4, 16))}   # (layers, tiles, ...)
    >>> program = program_for(loss_fn, {"blocks": {"w": jnp.ones((2, 16, 16)), "tiles": tiles}}, jnp.ones((4, 16)))
    >>> sorted((g.name, g.length) for g in program.streamed_groups())
    [('s:blocks.layer', 2), ('s:blocks.tiles1', 16)]
"""

from __future__ import annotations

import dataclasses

from zinfjax.program import jaxpr as jx
from zinfjax.program.ir import DOCS, Group, NoScan, ProgramError, Stream


@dataclasses.dataclass(eq=False)
class Body:
    """An outer scan's body as stages (positions ``0 .. 2n``): what one outer iteration runs.

    It has what `zinfjax.program.stages.StageFunctions` needs of a program (``constants``,
    ``param_vars`` by leaf index, ``stages``), so the stage functions of a body are built as a program's.
    What the engine reads of it besides its stages: ``inputs``, the body's variables for the outer scan's
    operands in order, and ``results``, its outputs in order (carry, then ys), each ``("var", v)`` or
    ``("literal", value)`` as `zinfjax.program.ir.Scan` describes operands.
    """

    closed: object  # the body's closed jaxpr, every call inlined
    stages: list
    param_vars: dict  # leaf index -> the body variable that holds it (a layer's slice, or a whole parameter)
    num_consts: int
    num_carry: int
    streams: dict  # leaf index -> how the body's tile scans cut it (`Stream`), None where it reads it whole
    inputs: tuple = dataclasses.field(init=False)
    results: tuple = dataclasses.field(init=False)

    def __post_init__(self):
        jaxpr = self.closed.jaxpr
        self.inputs = tuple(jaxpr.invars)
        self.results = tuple(("var", v) if jx.is_var(v) else ("literal", v.val) for v in jaxpr.outvars)

    @property
    def constants(self) -> dict:
        return dict(zip(self.closed.jaxpr.constvars, self.closed.consts, strict=True))


def nest(program, splitter):
    """``program`` with each streamed scan whose body scans over tiles cut again (see the module docstring).

    ``splitter(closed, eqns, param_vars, paths)`` is `zinfjax.program.split`'s cutter, so a body is cut by the
    same rules as the loss.
    """
    for stage in program.scans():
        body = _body(program, stage, splitter)
        if body is not None:
            stage.body = body
            _regroup(program, stage)
    return program


def _body(program, stage, splitter) -> Body | None:
    closed = jx.inline_calls(stage.eqn.params["jaxpr"], keep=lambda jaxpr: False)
    invars = closed.jaxpr.invars
    held = {what: invars[j] for j, (kind, what) in enumerate(stage.operands) if kind in ("stream", "param")}
    if not any(e.primitive.name == jx.SCAN for e in closed.jaxpr.eqns):
        return None
    paths = [leaf.path for leaf in program.leaves]
    for k in stage.streams:
        if program.leaves[k].stream.rows:
            raise ProgramError(f"parameter {paths[k]} is streamed in row chunks by a scan whose body scans over "
                               f"tiles; stack its layers instead (see {DOCS})")
    param_vars = [held[k] if k in held else jx.placeholder() for k in range(len(program.leaves))]
    finals = [v for v in closed.jaxpr.outvars if jx.is_var(v)]
    eqns = jx.dce(closed.jaxpr.eqns, finals)
    cutter = splitter(closed, eqns, param_vars, paths)
    cutter.in_body = True
    try:
        stages, leaves, _ = cutter.cut(finals)
    except NoScan:
        return None
    return Body(closed, stages, held, stage.num_consts, stage.num_carry, {k: leaves[k].stream for k in held})


def _owners(program, stage) -> dict[int, tuple[int, int]]:
    """Each leaf the scan streams: ``(the body stage that owns it, its tiles)`` (tiles 0: a layer leaf)."""
    body, out = stage.body, {}
    for k in stage.streams:
        users = [s for s in body.stages if k in s.params or (s.kind == "scan" and k in s.streams)]
        tiled = [s for s in users if s.kind == "scan" and k in s.streams]
        if tiled and len(users) > 1:
            raise ProgramError(f"tile parameter {program.leaves[k].path} is used outside its tile scan; a tile "
                               f"leaf must be read by its own scan over tiles alone (see {DOCS})")
        if tiled:
            out[k] = (tiled[0].position, _tiles(program.leaves[k].path, body.streams[k]))
        else:  # one group for the layer's other leaves, read once per layer (`zinfjax.engine._nested`)
            out[k] = (body.stages[0].position, None)
    return out


def _tiles(path: str, inner: Stream) -> tuple[int, int | None]:
    """``(tiles, axis)`` of a tile leaf, from how its tile scan cuts the layer (`Stream`)."""
    if inner.tiles:
        return inner.tiles, inner.axis
    if inner.rows and inner.pad:
        raise ProgramError(f"tile parameter {path} is padded to make its tiles; cut it into tiles of one size (a "
                           "tile count that divides its dimension)")
    return inner.length, (0 if inner.rows else None)


def _regroup(program, stage) -> None:
    """The scan's group replaced by one group per owning body stage (see the module docstring)."""
    for other in program.scans():
        if other is not stage and set(other.streams) & set(stage.streams):
            raise ProgramError(f"parameter {program.leaves[sorted(set(other.streams) & set(stage.streams))[0]].path} "
                               "is streamed by two scans, one of them over tiles; zinfjax streams a tiled layer's "
                               "parameters in one scan")
    owners = _owners(program, stage)
    members: dict[tuple, list[int]] = {}
    for k, (sub, cut) in sorted(owners.items()):
        members.setdefault((sub, cut[0] if cut else 0), []).append(k)
    old = {program.leaves[k].group for k in stage.streams}
    groups = {}
    for name, g in program.groups.items():
        if name not in old:
            groups[name] = g
            continue
        for (sub, tiles), ks in sorted(members.items()):
            new = _name(program, list(owners), sub, tiles)
            length = stage.length * (tiles or 1)
            groups[new] = Group(new, stage.position, tuple(ks), length, sub=sub)
            for k in ks:
                axis = owners[k][1][1] if owners[k][1] else None
                program.leaves[k] = dataclasses.replace(program.leaves[k], group=new,
                                                        stream=Stream(length, tiles=tiles, axis=axis))
    program.groups = groups


def _name(program, leaves: list[int], sub: int, tiles: int) -> str:
    """``s:`` and the common path prefix of the scan's leaves, then ``tiles`` and the body stage of a tile group
    (``s:blocks.tiles1``), or ``layer`` for the layer's other leaves (``s:blocks.layer``)."""
    parts = [program.leaves[k].path.split("/") for k in leaves]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return f"s:{'.'.join(common) or 'params'}." + (f"tiles{sub}" if tiles else "layer")
