"""A step's optimizer updates: each unit's fused update as its gradient completes, or the sweeps after the backward.

As soon as a unit's gradient is complete (its first user in forward order has run its backward), the
backward hands it to `Updates`: updated at once when the transformation is elementwise, or spooled
to the gradient tier when it needs more sweeps (per-tensor norms, a global norm, fp16's overflow
check) and updated after the backward pass, one sweep over every unit at a time (docs/design.md,
invariant 1). A layer updated in parts (`zinfjax.engine.parts`) waits here for its parts' operations.
Each update writes the new compute copy, master and optimizer state back to their stores, and hands
the compute copy to the next step's forward where the engine's plan says so (`EnginePlan.handoff`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from zinfjax.engine._step_io import StepEngine, StepIO, track
from zinfjax.engine.parts import Part
from zinfjax.engine.readahead import Read, ReadAhead
from zinfjax.engine.stores import dir_name
from zinfjax.program.optimizer import combine_partials
from zinfjax.store.layout import HOST_KINDS


class Updates:
    """The optimizer's side of one step: the gradients it is given, the updates it runs and what they leave."""

    def __init__(self, engine: StepEngine, io: StepIO):
        self.engine, self.io, self.program = engine, io, engine.program
        self._whole_grads: dict = {}  # whole groups' gradients, by leaf, accumulated until their update
        self._pending: dict = {}  # (group, i) -> (its params, {leaf: gradient}) until its update parts have run
        self._partials: dict = {}  # the cross-unit statistics' partial values, by variable
        self._finite: list = []  # whether each spooled gradient is finite

    def _store(self, kind: str, group: str):
        return self.engine.stores.kind(kind)[group]

    def add_grads(self, grads: dict) -> None:
        """Gradients of whole groups' leaves (``{leaf: gradient}``), added to what earlier stages gave."""
        for k, g in grads.items():
            self._whole_grads[k] = self._whole_grads[k] + g if k in self._whole_grads else g

    def hold(self, group: str, i: int, params_tree: dict | None, grads: dict) -> None:
        """Unit ``i`` of ``group`` is updated in parts: its gradients ``{leaf: gradient}`` (and its compute copy,
        as the master when there is no other) wait for the parts' operations (`update_part`)."""
        frozen = self.engine.update_plan.frozen  # a frozen leaf's gradient has no update to wait for
        self._pending[(group, i)] = (params_tree, {k: g for k, g in grads.items() if k not in frozen})

    def reads(self, group: str, i: int, part: Part | None = None) -> list:
        """What a fused update of unit ``i`` (or of its leaves ``part``) needs beyond what the backward read:
        opt (and master)."""
        if self.engine.spools_gradients or self.engine.update_plan.frozen_group(group):
            return []
        reads, kind = [], self._kind("optimizer")
        if self.engine.update_plan.part_state(group, part and part.leaves):
            reads.append(Read(track("opt", group), self._store("opt", group), i, keys=part and part.state,
                              memory_kind=kind))
        if self.engine.stores.master:
            reads.append(Read(track("master", group), self._store("master", group), i, keys=part and part.params,
                              memory_kind=kind))
        return reads

    def _kind(self, tier_key: str) -> str:
        """The memory kind the update reads state of the tier ``tier_key`` into: host memory for the update on
        the host (unless the state is on the device), else device memory."""
        on_device = getattr(self.engine.settings.tiering, tier_key) == "device"  # a split is on host and nvme
        return self.engine.host_kind if self.engine.on_host and not on_device else "device"

    def discard(self, group: str) -> None:
        """Forgets the gradients of the whole group ``group``, which is frozen (no update takes them)."""
        for leaf in self.program.leaves_of(group):
            self._whole_grads.pop(leaf.index, None)

    def update_whole(self, done, trees: dict, upd: list) -> None:
        """The updates of the whole groups ``done`` (their gradients complete), from their compute copies ``trees``
        and their update reads ``upd`` (`reads`), in order."""
        for g in done:
            leaves = self.program.leaves_of(g.name)
            grads = [self._whole_grads.pop(leaf.index, None) for leaf in leaves]
            grads = [jnp.zeros(leaf.shape, jnp.float32) if x is None else x for leaf, x in zip(leaves, grads,
                                                                                               strict=True)]
            n = len(self.reads(g.name, 0))
            self.update_unit(g.name, 0, trees[g.name], grads, upd[:n])
            upd = upd[n:]

    def update_part(self, group: str, i: int, part: Part, upd: list) -> None:
        """The update of the leaves ``part`` of unit ``i``, from the gradients its backward left."""
        params_tree, grads = self._pending[(group, i)]
        mine = [grads.pop(k) for k in part.leaves]
        if not grads:
            del self._pending[(group, i)]
        self.update_unit(group, i, params_tree, mine, upd, part)

    def update_unit(self, group: str, i: int, params_tree: dict, grads: list, upd: list,
                    part: Part | None = None) -> None:
        """A unit's gradient is complete: update it (or its leaves ``part``) now (fused), or spool it for the sweeps."""
        engine = self.engine
        if engine.update_plan.frozen_group(group):  # no update, no write: the group stays as its store holds it
            return
        paths, state_paths = engine.units.paths(group, part and part.leaves)
        if engine.spools_gradients:
            spooled, finite = engine.units.spool(group)(grads)
            self.io.write(track("grads", group), self._store("grads", group), i,
                          dict(zip(paths, spooled, strict=True)))
            self._finite.append(finite)
            return
        has_state = bool(state_paths)
        opt = upd[0] if has_state else {}
        master = upd[1 if has_state else 0] if engine.stores.master else params_tree
        self._apply(group, i, [master[p] for p in paths], grads, [opt[p] for p in state_paths], sweep=0, totals=[],
                    grad_div=np.float32(1), donate=self._donated(group, i, has_state, grads), part=part)

    def _donated(self, group: str, i: int, has_state: bool, grads: list) -> tuple[int, ...]:
        """The fused update's arguments (master 0, gradients 1, state 2) whose buffers its outputs may take over
        (docs/design.md, invariant 2): its own gradient, and the master and state its stores hand over
        (`LayerStore.hands_over`: fresh buffers read from NVMe off the CPU backend, or an in-memory tier's own
        arrays, which the outputs replace there at once).

        JAX gives each output the first donated argument of its shape and dtype, in argument order, and the
        outputs are (compute copy, master, state). So only sets in which every output then takes its own
        input's buffer are donated: an output written into a buffer that another output still reads makes
        XLA copy that input first (32 copies of Adam's m and v per GPT-2 layer, before).
        """
        engine = self.engine
        opt = self._store("opt", group) if has_state else None
        if engine.on_host:  # gradients and in-memory state come from the device: no buffers its host outputs can reuse
            return (2,) if opt is not None and opt.tier_at(i) == "nvme" else ()
        state = opt is not None and opt.hands_over(i)
        master = self._store("master" if engine.stores.master else "params", group).hands_over(i)
        if not engine.stores.master:  # fp32: the compute copy is the master, and the first output
            return ((0,) if master else (1,)) + ((2,) if state else ())
        # Mixed precision: a gradient in the compute dtype becomes the compute copy; one in fp32 (a tied
        # parameter's, with a later stage's share added) would take the master's place.
        own = (1,) if all(g.dtype != jnp.float32 for g in grads) else ()
        return ((0,) if master else ()) + own + ((2,) if state and master else ())

    def _apply(self, group: str, i: int, master: list, grads: list, state: list, sweep: int, totals: list,
               grad_div, donate: tuple[int, ...] = (), part: Part | None = None) -> None:
        engine = self.engine
        leaves = part and part.leaves
        fn = engine.units.update(group, sweep, engine.units.size(group, i), donate, leaves)
        if engine.on_host:
            self.io.telemetry.add_link(self._link_bytes(master, grads, state, sweep))
        partials, compute, master, state = self.io.dispatch(f"update_{dir_name(group)}", i, fn, master, grads, state,
                                                            engine.globals, totals, engine.units.start(group, i),
                                                            grad_div)
        for c, value in zip(engine.update_plan.crosses_of(group, sweep), partials, strict=True):
            self._partials.setdefault(c.out, []).append(value)
        if sweep < engine.update_plan.sweeps - 1:
            return
        paths, state_paths = engine.units.paths(group, leaves)
        keys, host, write = part and part.params, engine.on_host, self.io.write
        if (group, i) in engine.handoff:  # the next step's forward reads it first (`engine_plan.plan_handoff`)
            engine.handed_over.keep((group, i), [dict(zip(paths, compute, strict=True))])
        write(track("params", group), self._store("params", group), i, dict(zip(paths, compute, strict=True)), keys,
              from_host=host)
        if engine.stores.master:
            write(track("master", group), self._store("master", group), i, dict(zip(paths, master, strict=True)), keys,
                  from_host=host)
        if state_paths:
            write(track("opt", group), self._store("opt", group), i, dict(zip(state_paths, state, strict=True)),
                  part and part.state, from_host=host)

    def _link_bytes(self, master: list, grads: list, state: list, sweep: int) -> int:
        """What the update on the host moves over the host link: its inputs that are in device memory, and
        (on the last sweep) the new compute copy when the parameters live on the device."""
        down = sum(x.nbytes for x in (*master, *grads, *state) if not on_host(x))
        up = 0
        if sweep == self.engine.update_plan.sweeps - 1 and self.engine.settings.tiering.params == "device":
            up = sum(x.size for x in master) * jnp.dtype(self.engine.compute_dtype).itemsize
        return down + up

    def finish(self) -> list | None:
        """After the backward pass: the sweeps (when spooled), then the optimizer's new global state; None
        when the step was skipped (fp16's overflow)."""
        engine, plan = self.engine, self.engine.update_plan
        if engine.spools_gradients:
            finite = bool(jnp.all(jnp.stack(self._finite))) if self._finite else True
            if engine.settings.numerics.precision == "fp16":
                engine.loss_scale.after_step(finite)
                if not finite:
                    return None
            engine.stores.flush()  # the spooled gradients land before the sweeps read them
            for sweep in range(plan.sweeps):
                self._sweep(sweep)
        totals = combine_partials(plan.crosses, self._partials)
        return list(plan.finish()(engine.globals, [totals[c.out] for c in plan.crosses]))

    def _sweep(self, sweep: int) -> None:
        engine = self.engine
        totals_vars = engine.update_plan.totals_before(sweep)
        done = combine_partials([c for c in engine.update_plan.crosses if c.phase < sweep], self._partials)
        totals = [done[v] for v in totals_vars]
        units = [(g, i) for g in self.program.groups.values() for i in range(g.length)
                 if not engine.update_plan.frozen_group(g.name)]
        source = "master" if engine.stores.master else "params"
        groups = []
        for g, i in units:
            reads = [Read(track(source, g.name), self._store(source, g.name), i,
                          memory_kind=self._kind("optimizer" if source == "master" else "params")),
                     Read(track("grads", g.name), self._store("grads", g.name), i,
                          memory_kind=self._kind("gradients"))]
            if engine.update_plan.state_of(g.name):
                reads.append(Read(track("opt", g.name), self._store("opt", g.name), i,
                                  memory_kind=self._kind("optimizer")))
            groups.append(reads)
        reads = ReadAhead(groups, engine.budget.prefetch_depth)
        grad_div = jnp.float32(engine.loss_scale.value)
        for (g, i), trees in zip(units, reads, strict=True):
            paths = [leaf.path for leaf in self.program.leaves_of(g.name)]
            state = [trees[2][s.path] for s in engine.update_plan.state_of(g.name)] if len(trees) > 2 else []
            self._apply(g.name, i, [trees[0][p] for p in paths], [trees[1][p] for p in paths], state, sweep, totals,
                        grad_div)
        self.io.telemetry.add_reads(reads)




def on_host(x) -> bool:
    """Whether array ``x`` is in host memory (one of `HOST_KINDS`)."""
    return getattr(getattr(x, "sharding", None), "memory_kind", None) in HOST_KINDS
