"""Compiled functions, cached per layout: an engine's placement, stage functions, update plan and unit functions.

An engine's stage and unit functions are compiled once per layout (program, optimizer, sharding, mesh,
precision) and shared by the engines of that layout: the four most recent layouts are kept, and a
closed engine's functions are freed with its layout's entry (docs/engine.md, "Compiled functions").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import optax
from jax.sharding import Mesh

from zinfjax.engine.placement import Placement
from zinfjax.engine.units import Units
from zinfjax.program.optimizer import UpdatePlan
from zinfjax.program.split import Program
from zinfjax.program.stages import StageFunctions
from zinfjax.sharding import ShardingRules


class Compiled(NamedTuple):
    """What one layout compiles, shared by the engines of that layout."""

    placement: Placement  # where every kind of value lives on the mesh
    stage_fns: StageFunctions  # the program's jitted stage functions
    plan: UpdatePlan  # the optimizer cut into per-unit functions
    units: Units  # the update of one unit in store layout


@functools.lru_cache(maxsize=4)
def compiled(program: Program, tx: optax.GradientTransformation, rules: ShardingRules, mesh: Mesh, compute_dtype,
             micro: int = 1, on_host: bool = False, params_kind: str = "device",
             host_kind: str = "pinned_host") -> Compiled:
    """The placement, stage functions, update plan and unit functions of one layout (shared by its engines)."""
    placement = Placement(program, rules, mesh)
    plan = update_plan(tx, program)
    units = Units(program, plan, compute_dtype, placement, on_host, params_kind, host_kind)
    return Compiled(placement, StageFunctions(program, placement, micro, plan.frozen), plan, units)


@functools.lru_cache(maxsize=4)
def update_plan(tx: optax.GradientTransformation, program: Program) -> UpdatePlan:
    """``tx`` cut into per-unit functions for ``program`` (see `UpdatePlan`), shared by the engines of both."""
    return UpdatePlan(tx, program)
