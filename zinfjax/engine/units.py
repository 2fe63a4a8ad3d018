"""The optimizer step on one unit: a slice as its store holds it, in and out of the update's own view.

A store holds a layer of a stacked leaf as ``leaf[i]`` and a row chunk padded to its full
``rows``; the update (`UpdatePlan`) sees the same data with the streamed axis kept (``leaf[i:i+1]``)
and only the rows that belong to the leaf. `Units` converts between the two and wraps each
per-unit function of the plan into one jitted step: gradients cast to fp32 and divided by the
loss scale, the update, the new compute copy cast to the compute dtype, and every output placed
in its store's layout.

With ``on_host`` (``update_on=host``) the update runs on the host CPU (``compute_on("device_host")``):
every input moves to host memory first (a no-op for the master and optimizer state, which the
host and NVMe tiers hand over in host memory), the new master and state stay there, and only the
compute copy goes to ``params_kind`` (device memory when the parameters live there).

Example (layer 2 of three, Adam, computing in bf16):
    >>> import optax
    >>> from zinfjax.engine.placement import Placement
    >>> from zinfjax.program import program_for
    >>> from zinfjax.program.optimizer import UpdatePlan
    >>> from zinfjax.sharding import ShardingRules, make_mesh
    >>> def loss_fn(params, batch):                  # three layers: a scan over their stacked weights
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch, params["blocks"])
    ...     return jnp.mean(h ** 2)
    >>> params = {"blocks": jnp.ones((3, 8, 8))}
    >>> program, mesh = program_for(loss_fn, params, jnp.ones((8, 8))), make_mesh({"data": 1})
    >>> plan = UpdatePlan(optax.adam(1e-3), program)
    >>> units = Units(program, plan, jnp.bfloat16, Placement(program, ShardingRules.for_mesh(mesh, 0), mesh))
    >>> size, start = units.size("s:blocks", 2), units.start("s:blocks", 2)
    >>> compute, master, state = units.init("s:blocks", size)([params["blocks"][2]], start)
    >>> grads = [jnp.ones((8, 8), jnp.bfloat16)]
    >>> update = units.update("s:blocks", 0, size)
    >>> partials, compute, master, state = update(master, grads, state, plan.init_globals(), [], start, 1.0)
    >>> compute[0].dtype, master[0].dtype, round(float(master[0][0, 0]), 6)    # one Adam step of 1e-3 down
    (dtype(bfloat16), dtype('float32'), 0.999)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from zinfjax.program.memo import instance_cache
from zinfjax.program.optimizer import UpdatePlan
from zinfjax.program.split import Program


class Units:
    """Per-unit init and update functions of an `UpdatePlan`, in store layout (see the module docstring)."""

    def __init__(self, program: Program, plan: UpdatePlan, compute_dtype, placement, on_host: bool = False,
                 params_kind: str = "device", host_kind: str = "pinned_host"):
        self.program, self.plan, self.compute_dtype, self.placement = program, plan, compute_dtype, placement
        self.on_host, self.params_kind, self.host_kind = on_host, params_kind, host_kind

    def size(self, group: str, i: int) -> int | None:
        """The unit's window size: 1 for a layer, the valid rows for a chunk, None for a whole group."""
        window = self.plan.window(group, i)
        return None if window is None else window.size

    def start(self, group: str, i: int) -> int:
        window = self.plan.window(group, i)
        return 0 if window is None else window.start

    # ---- layouts -------------------------------------------------------------------------------

    def _stream(self, group: str):
        return self.program.leaves[self.program.groups[group].leaves[0]].stream

    def to_unit(self, group: str, x, size: int | None):
        """A store slice as the update sees it."""
        stream = self._stream(group)
        if stream is None:
            return x
        return x[None] if stream.rows == 0 else x[:size]

    def from_unit(self, group: str, x):
        """An update output back in store layout (a chunk padded with zero rows)."""
        stream = self._stream(group)
        if stream is None:
            return x
        if stream.rows == 0:
            return x[0]
        pad = stream.rows - x.shape[0]
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x

    def _place(self, kind: str, paths: list[str], xs: list, host: bool = False) -> list:
        """``xs`` in their store layout; ``host``: where the update on the host leaves them (master and
        state in host memory, the compute copy in ``params_kind``)."""
        if not xs:  # an earlier sweep returns partials only
            return xs
        if host:
            return self._place_in(self.host_kind if kind != "params" else self.params_kind, kind, paths, xs)
        if self.placement.trivial:
            return xs
        return [jax.lax.with_sharding_constraint(x, self.placement.sharding(kind, p, x.shape))
                for p, x in zip(paths, xs, strict=True)]

    def _place_in(self, memory_kind: str, kind: str, paths: list[str], xs: list) -> list:
        """``xs`` moved to ``memory_kind`` in their store layout (inside a jitted function)."""
        if self.placement.trivial:
            space = jax.memory.Space.Device if memory_kind == "device" else jax.memory.Space.Host
            return [jax.device_put(x, space) for x in xs]
        return [jax.device_put(x, self.placement.sharding(kind, p, x.shape).with_memory_kind(memory_kind))
                for p, x in zip(paths, xs, strict=True)]

    # ---- functions -----------------------------------------------------------------------------

    def paths(self, group: str, part: tuple[int, ...] | None = None) -> tuple[list[str], list[str]]:
        """The parameter and state paths of ``group``'s leaves ``part`` (all when None), in store order."""
        paths = [leaf.path for leaf in self.program.leaves_of(group) if part is None or leaf.index in part]
        return paths, [s.path for s in self.plan.part_state(group, part)]

    @instance_cache  # compiled once per (group, sweep, size, donate, part) for the life of the units
    def update(self, group: str, sweep: int, size: int | None, donate: tuple[int, ...] = (),
               part: tuple[int, ...] | None = None):
        """A jitted ``f(master, grads, state, globals, totals, start, grad_div) -> (partials, compute, master, state)``.

        Inputs and outputs are lists in store layout (group leaf order; the group's state leaves),
        of the leaves ``part`` only when given; in fp32 ``master`` is empty (``compute`` is the master).
        ``grad_div`` divides the gradients first (the fp16 loss scale, else 1). ``donate``: the arguments whose
        buffers the outputs may take over (the caller holds no other reference).
        """
        unit = self.plan.unit(group, sweep, size, part)
        paths, state_paths = self.paths(group, part)

        def body(master, grads, state, globals_, totals, start, grad_div):
            master = [self.to_unit(group, x.astype(jnp.float32), size) for x in master]
            grads = [self.to_unit(group, g.astype(jnp.float32) / grad_div, size) for g in grads]
            state = [self.to_unit(group, x, size) for x in state]
            partials, new_master, new_state = unit(master, grads, state, globals_, totals, start)
            new_master = [self.from_unit(group, x) for x in new_master]
            compute = [x.astype(self.compute_dtype) for x in new_master]
            if jnp.dtype(self.compute_dtype) == jnp.float32:  # the compute copy is the master: one output (a
                new_master = []  # second of the same values would be a copy of every parameter)
            new_state = [self.from_unit(group, x) for x in new_state]
            return partials, compute, new_master, new_state

        def f(*args):
            if self.on_host:  # every input to host memory, the update on the host CPU, partials back to the device
                args = jax.device_put(args, jax.memory.Space.Host)
                partials, compute, new_master, new_state = compute_on("device_host")(jax.jit(body))(*args)
                partials = jax.device_put(partials, jax.memory.Space.Device)
            else:
                partials, compute, new_master, new_state = body(*args)
            h = self.on_host
            return (partials, self._place("params", paths, compute, h), self._place("master", paths, new_master, h),
                    self._place("opt", state_paths, new_state, h))

        return jax.jit(f, donate_argnums=donate)

    @instance_cache
    def compute_copy(self, group: str):
        """A jitted ``f(master) -> compute``: a unit's compute copy (a dict by path, store layout) cast from its fp32
        master and placed as `update` casts and places the copy it writes, so the two are equal bit for bit."""
        paths, _ = self.paths(group)

        def f(master: dict) -> dict:
            compute = [master[p].astype(self.compute_dtype) for p in paths]
            return dict(zip(paths, self._place("params", paths, compute), strict=True))

        return jax.jit(f)

    @instance_cache
    def init(self, group: str, size: int | None, part: tuple[int, ...] | None = None):
        """A jitted ``f(params, start) -> (compute, master, state)``: a unit's initial state from its parameters
        (those of the leaves ``part`` only, when given)."""
        init = self.plan.init_unit(group, size, part)
        paths, state_paths = self.paths(group, part)

        def f(params, start):
            master = [x.astype(jnp.float32) for x in params]
            state = init([self.to_unit(group, x, size) for x in master], start)
            state = [self.from_unit(group, x) for x in state]
            compute = [x.astype(self.compute_dtype) for x in master]
            return (self._place("params", paths, compute), self._place("master", paths, master),
                    self._place("opt", state_paths, state))

        return jax.jit(f)

    @instance_cache
    def spool(self, group: str):
        """A jitted ``f(grads) -> (fp32 grads, all finite)``: gradients on their way to the gradient tier."""
        paths = [leaf.path for leaf in self.program.leaves_of(group)]

        def f(grads):
            grads = [g.astype(jnp.float32) for g in grads]
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in grads]))
            return self._place("grads", paths, grads), finite

        return jax.jit(f)
