"""Initial parameters one layer at a time: the user's initialiser, run one scan iteration at a time.

``init_fn(rng) -> params`` (for Flax, ``lambda rng: model.init(rng, example)["params"]``) is traced
once on an abstract key. Stacked leaves are outputs of a scan over the layers (what ``nn.scan`` and
``nnx.vmap``/``nnx.scan`` produce when initialising): layer ``i`` of them is that scan's body run on
iteration ``i``'s inputs. Row-chunked leaves (an embedding table) are computed one chunk at a
time where their code is row-wise (`rows.row_chunk`). The rest of the tree is computed leaf group
by leaf group. So the whole tree never exists in memory, and the values are bitwise those of
``jax.jit(init_fn)(rng)``: the same operations on the same keys (tests/program/test_init.py).
This is what DeepSpeed's ``zero.Init`` does for torch, without hooks.

Example (for Flax, ``init_fn = lambda rng: model.init(rng, example)["params"]``):
    >>> import jax.numpy as jnp, optax, tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.engine import Engine
    >>> from zinfjax.program import program_for
    >>> from zinfjax.sharding import make_mesh
    >>> def loss_fn(params, batch):               # three layers: a scan over their stacked weights
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
    ...     return jnp.mean(h ** 2)
    >>> def init_fn(rng):                         # what nn.scan's init makes: a scan over the layers' keys
    ...     return {"blocks": jax.lax.map(lambda k: jax.random.normal(k, (8, 8)) / 8, jax.random.split(rng, 3))}
    >>> key, tx = jax.random.key(0), optax.adam(1e-3)
    >>> program = program_for(loss_fn, jax.eval_shape(init_fn, key), jnp.ones((8, 8)))
    >>> source = InitSource(program, init_fn, key)
    >>> config = Config(params="nvme", optimizer="nvme", nvme_path=tempfile.mkdtemp())
    >>> engine = Engine(program, source, tx, config.engine_settings(), make_mesh({"data": 1}))  # layer by layer
    >>> bool((engine.params()["blocks"] == jax.jit(init_fn)(key)["blocks"]).all())   # init_fn's values, bitwise
    True
    >>> engine.close()
"""

from __future__ import annotations

import jax

from zinfjax.errors import UserError
from zinfjax.program import blocks, rows
from zinfjax.program import jaxpr as jx
from zinfjax.program.memo import instance_cache
from zinfjax.program.split import store_slice


class InitError(UserError):
    """The initialiser does not produce the parameters the loss function takes."""


class InitSource:
    """The engine's initial parameters from ``init_fn(rng)``, one unit at a time (see the module docstring)."""

    step = 0
    loss_scale = None
    loss_scale_good = 0

    def __init__(self, program, init_fn, rng):
        self.program, self.rng = program, rng
        closed, out_tree = jx.trace(init_fn, jax.ShapeDtypeStruct((), rng.dtype))
        if out_tree != program.params_tree:
            raise InitError(f"init_fn returns a tree of another structure than the loss function's parameters: "
                            f"{out_tree} vs {program.params_tree}")
        self.closed = jx.inline_calls(closed)
        jaxpr = self.closed.jaxpr
        for leaf, v in zip(program.leaves, jaxpr.outvars, strict=True):
            if tuple(v.aval.shape) != leaf.shape:
                raise InitError(f"init_fn makes {leaf.path} of shape {tuple(v.aval.shape)}, the loss function takes "
                                f"{leaf.shape}")
        self._by_scan = self._scan_outputs()
        self._layer: dict = {}  # (scan eqn id, i) -> that iteration's outputs (the last one asked for)
        self._whole: dict = {}  # group -> its leaves computed whole

    def _scan_outputs(self) -> dict[int, tuple]:
        """Leaf index -> (scan eqn, index among its ys) for leaves stacked by a top-level scan."""
        jaxpr = self.closed.jaxpr
        producers = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == jx.SCAN:
                n_k = eqn.params["num_carry"]
                for j, v in enumerate(eqn.outvars[n_k:]):
                    producers[v] = (eqn, j)
        out = {}
        for leaf, v in zip(self.program.leaves, jaxpr.outvars, strict=True):
            if jx.is_var(v) and v in producers and leaf.stream is not None and leaf.stream.rows == 0:
                out[leaf.index] = producers[v]
        return out

    # ---- the source interface ------------------------------------------------------------------

    def params(self, group: str, i: int, only: frozenset | None = None) -> list:
        out = []
        for leaf in self.program.leaves_of(group):
            if only is not None and leaf.path not in only:
                out.append(None)
            elif leaf.index in self._by_scan:
                eqn, j = self._by_scan[leaf.index]
                out.append(self._unit(leaf, eqn, j, i, alone=only is not None and len(only) == 1))
            elif self._chunk_fn(leaf.index) is not None:
                out.append(self._chunk_fn(leaf.index)(self.rng, i * leaf.stream.rows))
            else:
                out.append(store_slice(leaf, self._group_whole(group)[leaf.index], i))
        return out

    def state(self, group: str, i: int) -> None:
        return None

    def globals(self) -> None:
        return None

    def _unit(self, leaf, eqn, j: int, i: int, alone: bool = False):
        """Unit ``i`` of a leaf a scan stacks: a layer, or one tile of one layer (alone where its code allows, or
        where ``alone`` asks: one leaf of a layer, not the whole layer's)."""
        tiles = leaf.stream.tiles
        alone = alone or self.program.groups[leaf.group].sub is not None  # a layer of tiles: never all at once
        if not tiles:
            return self._iteration(eqn, i, j if alone else None)[0 if alone else j]
        layer, t = divmod(i, tiles)
        fn = self._tile_fn(eqn, j, leaf.stream.axis, leaf.slice_shape) if leaf.stream.axis is not None else None
        if fn is None:
            return leaf.stream.tile(self._iteration(eqn, layer, j)[0], t)
        consts, xs = self._scan_inputs(eqn)
        return fn(consts, [x[layer] for x in xs], t)

    @instance_cache  # one compile per tiled leaf
    def _tile_fn(self, eqn, j: int, axis: int, tile_shape: tuple):
        """``f(consts, xs_i, t)``: tile ``t`` of output ``j`` of one iteration, computed alone (`blocks.block`);
        None where its code is not elementwise over random bits."""
        body = jx.inline_calls(eqn.params["jaxpr"], keep=lambda jaxpr: False)
        n_c, n_k = eqn.params["num_consts"], eqn.params["num_carry"]
        outvar = body.jaxpr.outvars[n_k + j]
        n = tile_shape[axis]
        if not jx.is_var(outvar):
            return None

        def f(consts, xs, t):
            env = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
            env.update(zip(body.jaxpr.invars[:n_c], consts, strict=True))
            env.update(zip(body.jaxpr.invars[n_c + n_k:], xs, strict=True))
            return blocks.block(body.jaxpr.eqns, env, outvar, axis, t * n, n)

        fn = jax.jit(f)
        consts, xs = self._scan_inputs(eqn)
        try:
            fn.lower(consts, [x[0] for x in xs], 0)
        except rows.Unsliceable:
            return None
        return fn

    # ---- evaluation ----------------------------------------------------------------------------

    @instance_cache  # one compile per row-chunked leaf
    def _chunk_fn(self, index: int):
        """``f(rng, lo)``: one row chunk of a row-chunked leaf, computed alone (`rows.row_chunk`); else None."""
        leaf = self.program.leaves[index]
        if leaf.stream is None or leaf.stream.rows == 0:
            return None
        outvar = self.closed.jaxpr.outvars[index]
        if not jx.is_var(outvar):
            return None
        fn = jax.jit(lambda rng, lo: rows.row_chunk(self.closed, outvar, rng, lo, leaf.stream.rows))
        try:
            fn.lower(self.rng, 0)
        except rows.Unsliceable:
            return None  # computed whole, then cut
        return fn

    def _group_whole(self, group: str) -> dict:
        """The group's leaves that no scan stacks, computed whole (kept while the group is filled)."""
        if group not in self._whole:
            self._whole = {group: self._whole_fn(group)(self.rng)}
        return self._whole[group]

    @instance_cache  # one compile per group, for the life of the source
    def _whole_fn(self, group: str):
        jaxpr = self.closed.jaxpr
        leaves = [leaf.index for leaf in self.program.leaves_of(group)
                  if leaf.index not in self._by_scan and self._chunk_fn(leaf.index) is None]
        outs = [jaxpr.outvars[k] for k in leaves]
        eqns = jx.dce(jaxpr.eqns, outs)

        def f(rng):
            env = dict(zip(jaxpr.constvars, self.closed.consts, strict=True)) | {jaxpr.invars[0]: rng}
            env = jx.evaluate(eqns, env)
            return dict(zip(leaves, [jx.read(env, v) for v in outs], strict=True))

        return jax.jit(f)

    def _iteration(self, eqn, i: int, output: int | None = None) -> list:
        """The outputs of iteration ``i`` (all, or ``output`` alone) of a scan that stacks parameters."""
        key = (id(eqn), i, output)
        if key not in self._layer:
            inputs = self._scan_inputs(eqn)
            self._layer = {key: self._body_fn(eqn, output)(*inputs, i)}
        return self._layer[key]

    @instance_cache
    def _scan_inputs(self, eqn) -> tuple:
        """The scan's consts and stacked xs, computed once (keys and the like: small)."""
        jaxpr = self.closed.jaxpr
        consts, _, xs = jx.scan_parts(eqn)
        needed = [a for a in consts + xs if jx.is_var(a)]
        eqns = jx.dce(jaxpr.eqns[: jaxpr.eqns.index(eqn)], needed)

        def f(rng):
            env = dict(zip(jaxpr.constvars, self.closed.consts, strict=True)) | {jaxpr.invars[0]: rng}
            env = jx.evaluate(eqns, env)
            return [jx.read(env, a) for a in consts], [jx.read(env, a) for a in xs]

        return jax.jit(f)(self.rng)

    @instance_cache
    def _body_fn(self, eqn, output: int | None = None):
        """``f(consts, xs, i) -> ys of iteration i`` (or ``[ys[output]]``), with the carry dropped when the
        parameters do not need it."""
        body = eqn.params["jaxpr"]
        n_c, n_k = eqn.params["num_consts"], eqn.params["num_carry"]
        ys = body.jaxpr.outvars[n_k:] if output is None else [body.jaxpr.outvars[n_k + output]]
        eqns = jx.dce(body.jaxpr.eqns, ys)
        carry = body.jaxpr.invars[n_c : n_c + n_k]
        if any(v in set(jx.free_vars(eqns)) for v in carry):
            raise InitError("the initialiser's scan computes the parameters of a layer from the previous layer's "
                            "output; zinfjax initialises one layer at a time, so each layer's parameters must depend "
                            "only on its key (nn.scan with split_rngs={'params': True} does)")

        def f(consts, xs, i):
            env = dict(zip(body.jaxpr.constvars, body.consts, strict=True))
            env.update(zip(body.jaxpr.invars[:n_c], consts, strict=True))
            env.update(zip(body.jaxpr.invars[n_c + n_k:], [x[i] for x in xs], strict=True))
            env = jx.evaluate(eqns, env)
            return [jx.read(env, v) for v in ys]

        return jax.jit(f)
