"""A loss function, cut where it scans over stacked parameters: the program the engine streams.

``loss_fn(params, batch[, rng])`` is traced to a jaxpr (once, on abstract values). Every top-level
``scan`` that takes a parameter leaf as its per-iteration input (what ``flax.linen.scan`` with
``variable_axes={"params": 0}`` and ``nnx.scan`` produce) is a *streamed scan*: its parameters
are read one iteration (one layer) at a time. The rest of the jaxpr falls into the stretches
between the scans. The program is then::

    whole_0 -> scan_1 -> whole_1 -> ... -> scan_n -> whole_n -> loss

A parameter is streamed when a scan takes it as ``xs``, directly (a stacked leaf ``(L, ...)``,
one layer per iteration) or as row chunks (``reshape(pad(leaf))`` to ``(C, r, ...)``: how the
reference models stream their vocabulary). Every other parameter is read whole by the
stretches (or scan consts) that use it. A leaf used by several stages (a tied embedding) gets
the sum of its gradients. Values that one stage computes and a later one reads (masks,
positions, the embedding output, per-layer dropout keys) are *residuals*, held per micro-batch
for the step.

Each eqn between scans is placed as late as it can go: just before its first use, so that
residuals live as briefly as possible.

Example:
    >>> import jax.numpy as jnp
    >>> def loss_fn(params, x):                   # an encoder and a decoder: two scans over stacked layers
    ...     layer = lambda h, w: (jnp.tanh(h @ w), None)
    ...     h = jax.lax.scan(layer, x @ params["embed"], params["encoder"])[0]
    ...     h = jax.lax.scan(layer, h * 2, params["decoder"])[0]
    ...     return jnp.mean(h ** 2)
    >>> params = {"embed": jnp.ones((4, 8)), "encoder": jnp.ones((3, 8, 8)), "decoder": jnp.ones((2, 8, 8))}
    >>> program = split(loss_fn, params, jnp.ones((2, 4)))
    >>> [s.kind for s in program.stages]             # embed; encoder; h * 2; decoder; the loss
    ['whole', 'scan', 'whole', 'scan', 'whole']
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.program import jaxpr as jx
from zinfjax.program.ir import (  # noqa: F401 - the program's parts, where they were defined before
    DOCS,
    Group,
    Leaf,
    Loop,
    NoScan,
    Output,
    Program,
    ProgramError,
    Scan,
    Stream,
    Whole,
    store_slice,
    unslice,
)
from zinfjax.program.nested import nest
from zinfjax.sharding import path_str


def split(loss_fn, params_like, batch_like, with_rng: bool = False, nest_tiles: bool = True) -> Program:
    """Traces ``loss_fn(params, batch[, rng])`` on one micro-batch and cuts it at its streamed scans, and (with
    ``nest_tiles``) each streamed scan whose body scans over tiles again at its tile scans (`nest`).

    Raises:
        ProgramError: no scan takes the parameters, the loss is not a scalar, or a parameter is
            used both per layer and whole; the message names the fix.
    """
    params_like = jax.tree.map(_abstract, params_like)
    batch_like = jax.tree.map(_abstract, batch_like)
    args = (params_like, batch_like) + ((jax.ShapeDtypeStruct((), jax.random.key(0).dtype),) if with_rng else ())
    closed, _ = jx.trace(loss_fn, *args)
    # Every jit is inlined: a parameter's chunk view (jnp.pad, reshape) must show at the top level.
    closed = jx.inline_calls(closed, keep=lambda jaxpr: False)
    p_leaves, p_tree = jax.tree_util.tree_flatten_with_path(params_like)
    b_leaves, b_tree = jax.tree_util.tree_flatten(batch_like)
    jaxpr = closed.jaxpr
    n_p, n_b = len(p_leaves), len(b_leaves)
    param_vars, batch_vars = jaxpr.invars[:n_p], jaxpr.invars[n_p : n_p + n_b]
    rng_var = jaxpr.invars[n_p + n_b] if with_rng else None
    loss_var = _check_loss(jaxpr)
    paths = [path_str(p) for p, _ in p_leaves]
    eqns = jx.dce(jaxpr.eqns, [loss_var])
    program = _Splitter(closed, eqns, param_vars, paths).build(
        batch_vars=batch_vars, rng_var=rng_var, loss_var=loss_var, params_tree=p_tree, batch_tree=b_tree,
        batch_like=b_leaves)
    program.leaves = [dataclasses.replace(leaf, keys=plain_keys(p)) for leaf, (p, _) in zip(program.leaves, p_leaves,
                                                                                              strict=True)]
    return nest(program, _Splitter) if nest_tiles else program


def plain_keys(path) -> tuple:
    """A jax key path as plain keys: str, or int for a sequence index.

    Example:
        >>> plain_keys(jax.tree_util.tree_flatten_with_path({"a": [0, {"b": 1}]})[0][1][0])
        ('a', 1, 'b')
    """
    keys = []
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            keys.append(k.idx)
        elif isinstance(k, jax.tree_util.DictKey):
            keys.append(k.key if isinstance(k.key, int) else str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            keys.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            keys.append(k.key)
        else:
            keys.append(str(k))
    return tuple(keys)


_PROGRAMS: dict = {}


def program_for(loss_fn, params_like, batch_like, with_rng: bool = False, nest_tiles: bool = True) -> Program:
    """`split`, cached by the loss function and the abstract inputs, so engines of one model share compiles.

    Example:
        >>> import jax.numpy as jnp
        >>> def loss(params, x):                        # three layers: a scan over their stacked weights
        ...     return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["w"])[0])
        >>> params_like = {"w": jax.ShapeDtypeStruct((3, 8, 8), jnp.float32)}
        >>> batch_like = jax.ShapeDtypeStruct((4, 8), jnp.float32)
        >>> program_for(loss, params_like, batch_like) is program_for(loss, params_like, batch_like)
        True
    """
    key = (loss_fn, _signature(params_like), _signature(batch_like), with_rng, nest_tiles)
    if key not in _PROGRAMS:
        if len(_PROGRAMS) >= 32:
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        _PROGRAMS[key] = split(loss_fn, params_like, batch_like, with_rng, nest_tiles)
    return _PROGRAMS[key]


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype))
                          for x in leaves)


def _abstract(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype)


def _check_loss(jaxpr):
    if len(jaxpr.outvars) != 1:
        raise ProgramError(f"loss_fn must return one scalar, got {len(jaxpr.outvars)} outputs; return the loss "
                           "alone (for metrics, compute them outside the step)")
    out = jaxpr.outvars[0]
    aval = out.aval
    if aval.shape != () or not jnp.issubdtype(aval.dtype, jnp.floating):
        raise ProgramError(f"loss_fn must return a float scalar, got {aval.dtype}{list(aval.shape)}; reduce it "
                           "to its mean (e.g. jnp.mean(losses))")
    if not jx.is_var(out):
        raise ProgramError("loss_fn returns a constant: the loss does not depend on the parameters")
    return out


class _Splitter:
    """The bookkeeping of one split (see `split`)."""

    def __init__(self, closed, eqns, param_vars, paths):
        self.closed, self.eqns, self.paths = closed, eqns, paths
        self.param_index = {v: k for k, v in enumerate(param_vars)}
        self.param_vars = list(param_vars)
        self.producer = {v: e for e in eqns for v in e.outvars if jx.is_var(v)}
        self.users = jx.consumers(eqns)
        self.in_body = False  # cutting a layer's body: parameters may be cut into tile views (`_tile_view`)

    # ---- streamed scans ------------------------------------------------------------------------

    def _view(self, x, length: int):
        """``(leaf, Stream, absorbed eqns)`` when scan input ``x`` is a slice view of a parameter."""
        if not jx.is_var(x):
            return None
        if x in self.param_index:
            leaf = self.param_index[x]
            return (leaf, Stream(length), []) if x.aval.shape[:1] == (length,) else None
        tiled = self._tile_view(x, length)
        if tiled is not None:
            return tiled
        reshape = self.producer.get(x)
        if reshape is None or reshape.primitive.name != "reshape" or reshape.params.get("dimensions"):
            return None
        y = reshape.invars[0]
        new = tuple(reshape.params["new_sizes"])
        if not jx.is_var(y) or len(new) < 2 or new[0] != length or y.aval.shape != (new[0] * new[1], *new[2:]):
            return None
        if y in self.param_index:
            return self.param_index[y], Stream(length, rows=new[1]), [reshape]
        pad = self.producer.get(y)
        if pad is None or pad.primitive.name != "pad" or pad.invars[0] not in self.param_index:
            return None
        config = pad.params["padding_config"]
        high_only = config[0][0] == 0 and config[0][2] == 0 and all(tuple(c) == (0, 0, 0) for c in config[1:])
        if not self._is_zero(pad.invars[1]) or not high_only:
            return None
        return self.param_index[pad.invars[0]], Stream(length, rows=new[1], pad=config[0][1]), [pad, reshape]

    def _tile_view(self, x, length: int):
        """``(leaf, Stream, absorbed eqns)`` when ``x`` cuts axis ``a`` of a parameter into ``length`` blocks and
        moves them in front: ``moveaxis(p.reshape(..., length, size, ...), a, 0)``, a tile view (in a layer's body)."""
        transpose = self.producer.get(x)
        if not self.in_body or transpose is None or transpose.primitive.name != "transpose":
            return None
        reshape = self.producer.get(transpose.invars[0])
        if reshape is None or reshape.primitive.name != "reshape" or reshape.params.get("dimensions"):
            return None
        p, new = reshape.invars[0], tuple(reshape.params["new_sizes"])
        if not jx.is_var(p) or p not in self.param_index:
            return None
        shape, perm = tuple(p.aval.shape), tuple(transpose.params["permutation"])
        for a in range(len(shape)):
            split_a = (*shape[:a], length, shape[a] // length, *shape[a + 1:])
            moved = (a, *range(a), *range(a + 1, len(split_a)))
            if shape[a] % length == 0 and new == split_a and perm == moved:
                return self.param_index[p], Stream(length, tiles=length, axis=a), [reshape, transpose]
        return None

    def _is_zero(self, atom) -> bool:
        """Whether ``atom`` is a zero scalar: a literal, or a literal cast to another dtype."""
        def cast(a):
            return jx.is_var(a) and a in self.producer and self.producer[a].primitive.name == "convert_element_type"

        while cast(atom):
            atom = self.producer[atom].invars[0]
        return not jx.is_var(atom) and float(np.asarray(atom.val)) == 0.0

    def _find_scans(self):
        scans = []
        for eqn in self.eqns:
            if eqn.primitive.name != jx.SCAN:
                continue
            _, _, xs = jx.scan_parts(eqn)
            views = {j: v for j, x in enumerate(xs) if (v := self._view(x, int(eqn.params["length"]))) is not None}
            if views:
                scans.append((eqn, views))
        if not scans:
            raise NoScan(
                "the loss does not scan over stacked parameters, so there are no layers to stream; write the "
                "repeated blocks with flax.linen.scan (variable_axes={'params': 0}) or nnx.scan, or restack a "
                f"Python loop of identical blocks with zinfjax.stack_layers (see {DOCS})")
        return scans

    # ---- the split -----------------------------------------------------------------------------

    def build(self, **fields) -> Program:
        stages, leaves, groups = self.cut([fields["loss_var"]])
        return Program(closed=self.closed, leaves=leaves, groups=groups, stages=stages, param_vars=self.param_vars,
                       **fields)

    def cut(self, finals: list):
        """The stages, leaves and groups of the eqns, whose results ``finals`` (the loss) are read after the last."""
        scans = self._find_scans()
        absorbed = {id(e) for _, views in scans for _, _, eqs in views.values() for e in eqs}
        streams = self._streams(scans)
        scan_pos = {id(eqn): 2 * k + 1 for k, (eqn, _) in enumerate(scans)}
        last = 2 * len(scans)
        rest = [e for e in self.eqns if id(e) not in absorbed and id(e) not in scan_pos]
        self._check_absorbed(scans, absorbed)
        placed = self._place(rest, scan_pos, last, finals)
        whole_use = self._whole_uses(placed, scans, scan_pos)
        for leaf in set(whole_use) & set(streams):
            raise ProgramError(f"parameter {self.paths[leaf]} is used both one layer at a time (by a scan) and whole; "
                               f"use it in one way, e.g. keep it out of the scanned tree (see {DOCS})")
        leaves, groups = self._groups(streams, whole_use, scan_pos)
        stages = []
        for k, (eqn, views) in enumerate(scans):
            stages.append(self._whole(2 * k, placed))
            stages.append(self._scan(2 * k + 1, eqn, views))
        stages.append(self._whole(last, placed))
        self._wire(stages, finals)
        return stages, leaves, groups

    def _check_absorbed(self, scans, absorbed) -> None:
        """A padded or reshaped parameter view must feed streamed scans only."""
        allowed = absorbed | {id(eqn) for eqn, _ in scans}
        for eqn in self.eqns:
            if id(eqn) not in absorbed:
                continue
            for v in eqn.outvars:
                for k in self.users.get(v, []):
                    if id(self.eqns[k]) not in allowed:
                        leaf = self.paths[self.param_index[_root(eqn, self.producer)]]
                        raise ProgramError(f"parameter {leaf} is reshaped into chunks for a scan and also used "
                                           f"otherwise (by {self.eqns[k].primitive.name}); use the chunks only in "
                                           "scans")

    def _streams(self, scans) -> dict[int, list]:
        """Each streamed leaf with its ``(scan eqn id, Stream)`` uses, in forward order."""
        streams: dict[int, list] = {}
        for eqn, views in scans:
            for leaf, stream, _ in views.values():
                streams.setdefault(leaf, []).append((id(eqn), stream))
        for leaf, uses in streams.items():
            if len({s for _, s in uses}) > 1:
                raise ProgramError(f"parameter {self.paths[leaf]} is streamed by several scans in different ways "
                                   f"({sorted({str(s) for _, s in uses})}); cut it the same way in each")
        return streams

    def _place(self, rest, scan_pos, last, finals) -> dict[int, int]:
        """Each eqn's stretch: just before its first reader (latest placement)."""
        rest_ids = {id(e) for e in rest}
        where = {v: last for v in finals}  # variable -> position of its first reader
        placed: dict[int, int] = {}
        for k in reversed(range(len(self.eqns))):
            eqn = self.eqns[k]
            if id(eqn) in scan_pos:
                pos = scan_pos[id(eqn)] - 1
            elif id(eqn) in rest_ids:
                pos = min((where[v] for v in eqn.outvars if v in where), default=last)
                placed[k] = pos
            else:
                continue  # an absorbed view: its parameter is read by the scan
            for a in eqn.invars:
                if jx.is_var(a):
                    where[a] = min(where.get(a, last), pos)
        return placed

    def _whole_uses(self, placed, scans, scan_pos) -> dict[int, int]:
        """Each parameter read whole, with the first position that reads it."""
        uses: dict[int, int] = {}

        def use(a, pos):
            leaf = self.param_index[a]
            uses[leaf] = min(uses.get(leaf, pos), pos)

        for k, pos in placed.items():
            for a in self.eqns[k].invars:
                if jx.is_var(a) and a in self.param_index:
                    use(a, pos)
        for eqn, views in scans:
            consts, carry, xs = jx.scan_parts(eqn)
            streamed = {len(consts) + len(carry) + j for j in views}
            for i, a in enumerate(consts + carry + xs):
                if jx.is_var(a) and a in self.param_index and i not in streamed:
                    use(a, scan_pos[id(eqn)])
        return uses

    def _groups(self, streams, whole_use, scan_pos):
        """Each leaf's group: the first stage (forward order) that reads it."""
        owner = {leaf: ("s", min(scan_pos[sid] for sid, _ in uses)) for leaf, uses in streams.items()}
        owner.update({leaf: ("w", pos) for leaf, pos in whole_use.items()})
        members: dict[tuple, list[int]] = {}
        for leaf, key in sorted(owner.items()):
            members.setdefault(key, []).append(leaf)
        names = _group_names({key: [self.paths[k] for k in ks] for key, ks in members.items()})
        groups = {}
        for key, ks in sorted(members.items(), key=lambda kv: kv[0][1]):
            length = streams[ks[0]][0][1].length if key[0] == "s" else 1
            groups[names[key]] = Group(names[key], key[1], tuple(ks), length)
        unused = tuple(k for k in range(len(self.param_vars)) if k not in owner)
        if unused:  # no gradient reaches them, but the optimizer still updates them (weight decay)
            groups["w:unused"] = Group("w:unused", 10**9, unused, 1)
        group_of = {k: g.name for g in groups.values() for k in g.leaves}
        leaves = [Leaf(k, self.paths[k], tuple(v.aval.shape), np.dtype(v.aval.dtype), group_of[k],
                       streams[k][0][1] if k in streams else None) for k, v in enumerate(self.param_vars)]
        return leaves, groups

    def _whole(self, position: int, placed) -> Whole:
        eqns = [self.eqns[k] for k, pos in sorted(placed.items()) if pos == position]
        params = sorted({self.param_index[a] for e in eqns for a in e.invars if jx.is_var(a) and a in self.param_index})
        inputs = [a for a in jx.free_vars(eqns) if a not in self.param_index]
        return Whole(position, eqns, params, inputs, outputs=[])

    def _scan(self, position: int, eqn, views) -> Scan:
        consts, carry, xs = jx.scan_parts(eqn)
        operands, params, streams, inputs = [], [], [], []
        for i, a in enumerate(consts + carry + xs):
            j = i - len(consts) - len(carry)
            if j >= 0 and j in views:
                leaf = views[j][0]
                operands.append(("stream", leaf))
                streams.append(leaf)
            elif jx.is_var(a) and a in self.param_index:
                operands.append(("param", self.param_index[a]))
                params.append(self.param_index[a])
            elif jx.is_var(a):
                operands.append(("var", a))
                if a not in inputs:
                    inputs.append(a)
            else:
                operands.append(("literal", a.val))
        return Scan(position, eqn, _loop(eqn), operands, sorted(set(params)), streams, inputs, outputs=[])

    def _wire(self, stages, finals) -> None:
        """Each stage's outputs: the variables it defines that a later stage (or the loss) reads."""
        defined_by: dict = {}
        for stage in stages:
            outs = stage.eqn.outvars if stage.kind == "scan" else [v for e in stage.eqns for v in e.outvars]
            for v in outs:
                if jx.is_var(v):
                    defined_by[v] = stage
        readers = [(s, s.inputs) for s in stages] + [(None, finals)]
        for _, reads in readers:
            for v in reads:
                stage = defined_by.get(v)
                if stage is not None and v not in stage.outputs:
                    stage.outputs.append(v)


def _loop(eqn) -> Loop:
    """What the engine reads of a scan equation (`Loop`): its parameters and its outputs."""
    params, n_k = eqn.params, int(eqn.params["num_carry"])
    outs = tuple(Output(v, jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype), dropped=not jx.is_var(v))
                 for v in eqn.outvars)
    return Loop(int(params["length"]), bool(params["reverse"]), int(params["num_consts"]), n_k, outs[:n_k], outs[n_k:])


def _root(eqn, producer):
    """The parameter variable under an absorbed pad/reshape chain."""
    a = eqn.invars[0]
    while a in producer and producer[a].primitive.name in ("pad", "reshape", "transpose"):
        a = producer[a].invars[0]
    return a


def _group_names(members: dict[tuple, list[str]]) -> dict[tuple, str]:
    """Readable group names: ``s:`` (streamed) or ``w:`` (whole), then the leaves' common path prefix."""
    names = {}
    for key, paths in members.items():
        parts = [p.split("/") for p in paths]
        common = []
        for level in zip(*parts, strict=False):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        base = re.sub(r"[^A-Za-z0-9_.\-]", "_", ".".join(common) or "params")
        names[key] = f"{key[0]}:{base}"
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    return {key: (f"{name}@{key[1]}" if counts[name] > 1 else name) for key, name in names.items()}
