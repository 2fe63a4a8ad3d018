"""The engine's plan, made before any store opens: memory budget, recomputation, reuse and handoff.

Everything here is decided from what is known before the state is written: the settings the user gave
(`zinfjax.sections`), the program, its update plan, the specs of the stores the engine will open
(`store_specs`) and the platform. Nothing reads or holds a store. `plan_engine` makes the whole plan
(`EnginePlan`); `update_location` decides where the optimizer update runs, which the layout's compiled
functions depend on. What is derived stays in the plan: the settings keep what the user gave.
"""

from __future__ import annotations

import dataclasses

from zinfjax._util.byte_sizes import format_bytes
from zinfjax.engine import reuse
from zinfjax.engine.budget import LIVE_BASE, Budget, MemoryBudgetError, fits_device, make_budget
from zinfjax.engine.parts import trainable_parts, update_parts
from zinfjax.engine.stores import StoreSpec, budget_needs, slice_bytes, written_alone
from zinfjax.program.optimizer import UpdatePlan
from zinfjax.program.split import Program
from zinfjax.sections import Memory, Tiering


def update_location(tiering: Tiering, platform: str) -> str:
    """Where the optimizer update runs: ``device`` or ``host`` (``update_on``; docs/engine.md).

    ``auto`` runs it on the host when the optimizer state is on host or NVMe and the compute devices
    are accelerators: the state then never crosses the host link. On the CPU backend host and device
    are one memory and one processor, so ``auto`` keeps it on the device, which costs no copies.

    Example:
        >>> update_location(Tiering(optimizer="nvme", nvme_path="/x", update_on="auto"), "gpu")
        'host'
    """
    if tiering.update_on != "auto":
        return tiering.update_on
    return "host" if platform != "cpu" and tiering.optimizer != "device" else "device"


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What the plan is made from, all known before any store opens."""

    memory: Memory  # the budget's keys as the user gave them
    program: Program
    update_plan: UpdatePlan
    specs: list[StoreSpec]  # the state's stores (`store_specs`)
    acts: list[StoreSpec]  # the activations' stores, one per scan
    platform: str  # the compute devices' platform: "cpu", "gpu", "tpu"
    residual_bytes: int  # what this process's devices hold of one step's saved residuals, at most
    spools_gradients: bool  # `stores.spools_gradients`
    on_host: bool  # the optimizer update runs on the host (`update_location`)


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """How an engine runs its steps within its memory budget."""

    parts: dict  # {group: [Part]}: the groups updated in parts (`zinfjax.engine.parts`); empty: all whole
    budget: Budget  # the memory budget's buffers, read-ahead and writes in flight
    needs: tuple[int, int, int]  # the (read, write, resident) bytes the budget was planned for (`budget_needs`)
    saves_residuals: bool  # the backward takes the forward's residuals instead of recomputing it
    reuse: frozenset = frozenset()  # (scan position, iteration): parameters the backward takes from the forward
    handoff: frozenset = frozenset()  # (group, unit): updates handing their new compute copy to the next forward


def plan_engine(inputs: PlanInputs) -> EnginePlan:
    """The engine's plan: update parts and memory budget with recomputation, then reuse, then handoff."""
    planned = plan_reuse(inputs, plan_memory(inputs))
    return dataclasses.replace(planned, handoff=plan_handoff(inputs, planned.parts))


def plan_memory(inputs: PlanInputs) -> EnginePlan:
    """The update parts, the memory budget's plan, its needs (`budget_needs`), and whether the
    backward keeps the forward's residuals instead of recomputing it (`choose_budget`).

    Layers are updated whole while the budget holds that with room (a roomy budget): fewer
    operations cost less CPU time. A lean or refused budget takes the parts (`zinfjax.engine.parts`),
    whose largest operation reads less; ``sub_group_size`` cuts them as asked, whatever the budget.
    """
    memory, specs, acts, platform = inputs.memory, inputs.specs, inputs.acts, inputs.platform
    parts = update_parts(inputs.program, inputs.update_plan, specs, inputs.spools_gradients, memory.sub_group_size)
    alone = written_alone(inputs.program, inputs.update_plan, inputs.spools_gradients, platform)
    whole, kept = None, parts
    if parts and not memory.sub_group_size:
        kept = trainable_parts(inputs.program, inputs.update_plan, inputs.spools_gradients)
        whole = budget_needs(specs, acts, platform, kept, alone)
    needs = budget_needs(specs, acts, platform, parts, alone)
    plan, saves, chosen = choose_budget(memory, platform, inputs.residual_bytes, needs, whole)
    return EnginePlan(kept if chosen is whole else parts, plan, chosen, saves)


def choose_budget(memory: Memory, platform: str, residuals: int, needs: tuple, whole: tuple | None = None,
                  baseline: int | None = None) -> tuple[Budget, bool, tuple]:
    """The budget's plan, whether the residuals are kept, and the needs it was made for (`plan_memory`).

    ``needs``: the ``(read, write, resident)`` of `budget_needs` with the update in parts (or whole where no group
    is cut); ``whole``: those of whole layers where some group could be cut, taken while their budget is roomy.
    ``baseline``: what the process holds already (default: its resident memory now). `zinfjax.planning` asks the
    same of a placement before anything is built.

    Example:
        >>> plan, saves, chosen = choose_budget(Memory(memory_limit=2 << 30), "cpu", 50 << 20,
        ...                                     (90 << 20, 85 << 20, 0), baseline=300 << 20)
        >>> plan.prefetch_depth, saves
        (3, True)
    """
    if whole is not None:
        try:
            plan, saves = recompute_budget(memory, platform, residuals, *whole, baseline=baseline)
        except MemoryBudgetError:
            plan = None
        if plan is not None and not plan.lean:  # whole layers; a layer with frozen leaves updates its others alone
            return plan, saves, whole
    plan, saves = recompute_budget(memory, platform, residuals, *needs, baseline=baseline)
    return plan, saves, needs


def recompute_budget(memory: Memory, platform: str, residuals: int, read: int, write: int, resident: int,
                     baseline: int | None = None) -> tuple[Budget, bool]:
    """The budget's plan, and whether the ``residuals`` are kept (``recompute``; docs/engine.md, "Recomputation").

    ``auto`` keeps them when the budget holds them as well and stays roomy: on the CPU backend they
    count against the host budget; on an accelerator they must fit in half its free memory.
    """
    mode, cpu = memory.recompute, platform == "cpu"
    if mode == "always" or (mode == "auto" and not cpu and not fits_device(residuals)):
        return make_budget(memory, read, write, resident, baseline), False
    if not cpu:
        return make_budget(memory, read, write, resident, baseline), True
    try:
        plan = make_budget(memory, read, write, resident + residuals, baseline)
    except MemoryBudgetError as e:
        if mode == "never":
            raise MemoryBudgetError(f"{e}; recompute=never keeps {format_bytes(residuals)} of "
                                    "residuals (recompute=auto or always holds none)") from None
        return make_budget(memory, read, write, resident, baseline), False
    if mode == "never" or not plan.lean:
        return plan, True
    return make_budget(memory, read, write, resident, baseline), False


def plan_reuse(inputs: PlanInputs, memory: EnginePlan) -> EnginePlan:
    """``memory`` (`plan_memory`'s plan) with the scan iterations whose parameters the backward takes from the
    forward (`zinfjax.engine.reuse`), and the budget's plan holding them too.

    Unset, ``max_reuse_distance`` keeps those that fit beside the operations between their two uses in
    what the largest operation holds anyway (`reuse.within`), so the budget is unchanged. Set, it keeps
    those within that distance, as held state; refused in one line if the budget cannot hold them.
    """
    program, specs, base = inputs.program, inputs.specs, memory.budget
    limit = inputs.memory.max_reuse_distance
    found = reuse.candidates(program, specs)
    if limit is None:
        kept = reuse.within(found, reuse.timeline(program, _slice_sizes(specs)), LIVE_BASE,
                            _reuse_saves_a_read(inputs, memory.parts))
        return dataclasses.replace(memory, reuse=frozenset(c.key for c in kept))
    kept = reuse.choose(found, limit)
    if not kept or inputs.platform != "cpu":  # on an accelerator they are in device memory
        return dataclasses.replace(memory, reuse=frozenset(c.key for c in kept))
    read, write, resident = memory.needs
    held = resident + (inputs.residual_bytes if memory.saves_residuals else 0)
    nbytes = sum(c.nbytes for c in kept)
    try:
        plan = make_budget(inputs.memory, read, write, held + nbytes, baseline=base.baseline)
    except MemoryBudgetError:
        raise MemoryBudgetError(
            f"max_reuse_distance={limit} keeps {len(kept)} layers' parameters ({format_bytes(nbytes)}), more "
            f"than the memory budget of {format_bytes(base.limit)} ({base.source}) holds; lower it") from None
    return dataclasses.replace(memory, reuse=frozenset(c.key for c in kept), budget=plan)


def plan_handoff(inputs: PlanInputs, parts: dict) -> frozenset:
    """The ``(group, unit)`` whose update hands its new compute copy to the next step's forward
    (`reuse.handed_over`), when ``max_reuse_distance`` is unset: those whose forward read costs a transfer,
    updated whole in the backward (not in sweeps, not in ``parts``) on the device."""
    if inputs.memory.max_reuse_distance is not None or inputs.spools_gradients or inputs.on_host:
        return frozenset()
    program, costly = inputs.program, _reads_cost(inputs)
    kept = reuse.handed_over(program, _slice_sizes(inputs.specs), LIVE_BASE,
                             lambda key: all(g in costly and g not in parts and not inputs.update_plan.frozen_group(g)
                                             for g in _streamed(program, key[0])))
    return frozenset((g, c.key[1]) for c in kept for g in _streamed(program, c.key[0]))


def _streamed(program: Program, position: int) -> set[str]:
    """The groups the scan at ``position`` streams."""
    stage = next(s for s in program.stages if s.position == position)
    return {program.leaves[k].group for k in stage.streams}


def _reads_cost(inputs: PlanInputs) -> set:
    """The groups whose compute copy costs a transfer to read: on NVMe, or in host memory beside an
    accelerator (on the CPU backend a host-tier read copies nothing)."""
    cpu = inputs.platform == "cpu"
    return {s.group for s in inputs.specs
            if s.kind == "params" and ("nvme" in s.tiers or ("host" in s.tiers and not cpu))}


def _reuse_saves_a_read(inputs: PlanInputs, parts: dict):
    """Whether keeping a scan iteration's parameters saves its backward a transfer: every group it streams
    costs one to read (`_reads_cost`), and its backward would not cast the compute copy from the master
    its update reads anyway (`zinfjax.engine._step.Step._casts_compute_copy`)."""
    program, costly = inputs.program, _reads_cost(inputs)
    mixed = {s.group for s in inputs.specs if s.kind == "master"}
    casts = not (inputs.spools_gradients or inputs.on_host)

    def saves(key) -> bool:
        for group in _streamed(program, key[0]):
            owned = program.groups[group].position == key[0]
            frozen = inputs.update_plan.frozen_group(group)  # no update reads its master: no cast
            if group not in costly or (owned and casts and group in mixed and group not in parts and not frozen):
                return False
        return True

    return saves


def _slice_sizes(specs) -> dict:
    """``{(kind, group): bytes of one slice}`` of every store (`zinfjax.engine.reuse.timeline`)."""
    return {(s.kind, s.group): slice_bytes(s) for s in specs}
