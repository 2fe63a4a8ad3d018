"""The interface between a step and its engine: what the step reads of it, and the calls it acts through.

A step (`zinfjax.engine._step`) reads the engine's layout, plan and stores (`StepEngine`: public
attributes, which `Engine` has), and dispatches its computations, writes slices and reports through
a `StepIO` the engine makes for it: never through the engine's private parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from zinfjax.engine.budget import Budget
from zinfjax.engine.loss_scale import LossScale
from zinfjax.engine.reuse import Held
from zinfjax.engine.stores import EngineStores, dir_name
from zinfjax.engine.telemetry import StepTelemetry
from zinfjax.engine.units import Units
from zinfjax.program.optimizer import UpdatePlan
from zinfjax.program.split import Program
from zinfjax.program.stages import StageFunctions
from zinfjax.sections import EngineSettings


class StepEngine(Protocol):
    """What a step reads of its engine (`zinfjax.engine.Engine`)."""

    program: Program
    settings: EngineSettings  # the sections the engine was built from, as the user gave them
    budget: Budget  # the read-ahead and buffers the engine's memory budget settled
    micro: int  # micro-batches a step accumulates (``grad_accum``)
    compute_dtype: Any
    stage_fns: StageFunctions
    units: Units
    plan: UpdatePlan
    stores: EngineStores
    host_kind: str  # the host tier's memory kind
    on_host: bool  # the update runs on the host (`update_location`)
    spools_gradients: bool  # `zinfjax.engine.stores.spools_gradients`
    saves_residuals: bool  # the backward takes the forward's residuals instead of recomputing it
    parts: dict  # {group: [Part]} of the groups updated in parts
    reuse: frozenset  # (scan position, iteration) whose parameters the backward takes from the forward
    handoff: frozenset  # (group, unit) whose update hands its new compute copy to the next forward
    handed_over: Held  # the compute copies the last step's updates handed to this step's forward
    loss_scale: LossScale
    globals: list  # the optimizer's global state (the step count, ...), before this step


@dataclasses.dataclass(frozen=True)
class StepIO:
    """The calls a step acts through, made by its engine for that step."""

    dispatch: Callable  # (name, layer, fn, *args) -> fn(*args), dispatched asynchronously, traced and bounded
    write: Callable  # (track, store, i, tree, keys=None, from_host=False): slice i to store, bytes in flight bounded
    tied: dict[str, int]  # the streamed groups other scans stream too (`stores.tied_groups`)
    telemetry: StepTelemetry  # the step's metrics


def track(kind: str, group: str) -> str:
    """The telemetry track of a store: ``params_blocks``, ``opt_embed.wte.embedding``."""
    return f"{kind}_{dir_name(group)}"

