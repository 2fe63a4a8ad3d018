"""The cost model: whether a placement fits, the bytes it moves per step, and its predicted step time
(docs/planning.md)."""

from __future__ import annotations

import dataclasses
import itertools

from zinfjax._util.choices import TIER_KEYS, TIERS
from zinfjax.config import Config
from zinfjax.engine.budget import (
    COMPILE_RESERVE,
    LIVE_BASE,
    LIVE_PER_DEPTH,
    MemoryBudgetError,
    heap_room,
    memory_capped,
    minimum_bytes,
)
from zinfjax.engine.stores import StoreSpec, budget_needs
from zinfjax.planning.probes import disk_seconds
from zinfjax.planning.state import KIND_TIER, device_bytes
from zinfjax.sections import Memory

NOMINAL = {"disk_read_GBps": 1.0, "disk_write_GBps": 1.0, "host_copy_GBps": 4.0, "nvme_step_GBps": 1.0,
           "disk_efficiency": 1.0, "flops_per_s": 2e10}


# Reads and writes per byte of each kind in one step without probes (grad_accum 1, no gradient clipping).
NOMINAL_TRAFFIC = {"params": (2.0, 1.0), "master": (1.0, 1.0), "opt": (1.0, 1.0), "grads": (1.0, 1.0),
                   "acts": (1.0, 1.0)}


def placements(nvme: bool) -> list[dict[str, str]]:
    """Every assignment of the four tier keys to device, host and (with an nvme_path) nvme."""
    tiers = TIERS if nvme else tuple(t for t in TIERS if t != "nvme")
    return [dict(zip(TIER_KEYS, combo, strict=True)) for combo in itertools.product(tiers, repeat=4)]


def uses_reference(config: Config, tiers: dict[str, str]) -> bool:
    """``zinfjax train`` runs this placement on the in-memory reference trainer
    (see `zinfjax.trainers.build.uses_engine`)."""
    return config.stage == 0 and not config.save_dir and all(t == "device" for t in tiers.values())


def fit(config: Config, parts: dict, stores, tiers: dict[str, str], machine: dict, cut: dict | None = None,
        regime: str = "least") -> dict:
    """What ``tiers`` needs of host memory, device memory and disk, and what is short of each.

    ``cut``: the groups the engine updates in parts. ``regime``: the engine's budget
    (`zinfjax.engine.budget.make_budget`): its ``least``; ``roomy``, the step's saved residuals (no forward
    recomputed in the backward), whole layers updated (no parts), a second slice staged and one more operation
    read ahead; ``heap``, that and the heap's room to keep its freed pages (`zinfjax.engine.budget.heap_room`).
    """
    cpu = machine["platform"] == "cpu"
    held = {"device": 0, "host": 0, "nvme": 0}
    device_held = 0
    specs = []
    for kind, group, like in stores:
        spec = StoreSpec(kind, group, tiers[KIND_TIER[kind]], like)
        for tier in held:
            held[tier] += spec.bytes_on((tier,))
        if spec.tier == "device":  # a split holds host and nvme layers alone
            device_held += device_bytes(like)
        specs.append(spec)
    state, acts = [s for s in specs if s.kind != "acts"], [s for s in specs if s.kind == "acts"]
    read, write_slice, _ = budget_needs(state, acts, machine["platform"], cut)
    transient = parts["activation_transient"]
    if uses_reference(config, tiers):  # the whole state, the gradients and the activations at once
        resident = held["device"] + parts["gradients"] + parts["activations"]
        host_need = machine["baseline_bytes"] + resident + transient + COMPILE_RESERVE
    else:  # the engine's budget (zinfjax.engine.budget.make_budget), and one layer's transient
        resident = held["host"] + (held["device"] if cpu else 0)
        host_need = minimum_bytes(machine["baseline_bytes"], resident, read, write_slice) + transient
        if regime != "least":  # the roomy budget: residuals kept, whole layers updated, a second slice, one more ahead
            whole, write_slice, _ = budget_needs(state, acts, machine["platform"])
            host_need = minimum_bytes(machine["baseline_bytes"], resident + parts.get("residuals", 0), whole,
                                      write_slice) + transient + 2 * write_slice + LIVE_PER_DEPTH * whole
            host_need += heap_room(whole, resident) if regime == "heap" else 0
    need = {"host": host_need, "nvme": held["nvme"]}
    have = {"host": machine["host_bytes"], "nvme": machine["nvme_free_bytes"] or 0}
    if not cpu:
        need["device"] = device_held + transient + LIVE_BASE * read
        have["device"] = machine["device_bytes"] or 0
    short = {k: need[k] - have[k] for k in need if need[k] > have[k]}
    return {"need": need, "have": have, "short": short, "fits": not short}


def traffic(stores, tiers: dict[str, str], factors: dict | None) -> dict[str, float]:
    """Bytes read from and written to each tier per step.

    ``factors``: by tier, the reads and writes per byte each store made in a calibration run with every
    tier there (``{"device": {...}, "nvme": {...}}``); a tier without its own run takes the device run's.
    They differ: with the compute copy on NVMe, the backward casts it from the master instead of reading
    it again.
    """
    out = {f"{op}_{t}": 0.0 for t in TIERS for op in ("read", "write")}
    factors = factors or {}
    for kind, group, like in stores:
        spec = StoreSpec(kind, group, tiers[KIND_TIER[kind]], like)
        for tier in spec.tiers:
            n = spec.bytes_on((tier,))
            r, w = factors.get(tier, factors.get("device", {})).get(f"{kind}|{group}") or NOMINAL_TRAFFIC[kind]
            out[f"read_{tier}"] += r * n
            out[f"write_{tier}"] += w * n
    return out


# What a training process holds more when its engine measures its baseline than when the plan sized it: the model
# built, the program traced, the data opened. gpt2-large and llama-1b under tiers=auto: 205 MiB at the plan, 253-254
# MiB at the engine (the log's placement.baseline_bytes against budget.baseline). Without it the plan foresaw the
# heap kept at depth 2 where the engine, 49 MiB short of that, returned its pages at depth 3.
ENGINE_START_BYTES = 64 << 20


def engine_choice(config: Config, parts: dict, stores, tiers: dict[str, str], machine: dict,
                  cut: dict | None = None) -> dict | None:
    """What the engine's own plan (`zinfjax.engine.engine_plan.choose_budget`) makes of ``tiers`` at the budget it
    divides (``engine_host_bytes``: ``memory_limit`` itself), from the plan's figures and what the process will hold
    when the engine starts (`ENGINE_START_BYTES` above ``baseline_bytes``); None where it would refuse.

    ``recompute``: the backward runs the forward again; ``parts``: layers update in parts; ``lean``: one slice
    staged, one operation read ahead; ``keeps_heap``: room for the heap's freed pages; ``returns_pages``: a
    capped run on NVMe without that room, which gives them back and faults them in again (docs/engine.md, "Memory").
    """
    from zinfjax.engine.engine_plan import choose_budget

    platform = machine["platform"]
    specs = [StoreSpec(kind, group, tiers[KIND_TIER[kind]], like) for kind, group, like in stores]
    state, acts = [s for s in specs if s.kind != "acts"], [s for s in specs if s.kind == "acts"]
    needs = budget_needs(state, acts, platform, cut)
    whole = budget_needs(state, acts, platform) if cut else None
    limit = machine.get("engine_host_bytes", machine["host_bytes"])
    baseline = machine["baseline_bytes"] + ENGINE_START_BYTES
    memory = config.section(Memory)
    try:
        plan, saves, chosen = choose_budget(memory.replace(memory_limit=limit), platform, parts.get("residuals", 0),
                                            needs, whole, baseline=baseline)
    except MemoryBudgetError:
        return None
    capped = memory_capped(memory, dataclasses.replace(plan, source=machine["host_source"]))  # as the engine judges
    on_nvme = any("nvme" in s.tiers for s in specs)
    return {"recompute": not saves, "parts": bool(cut) and chosen is needs, "lean": plan.lean,
            "prefetch_depth": plan.prefetch_depth, "keeps_heap": plan.keeps_heap,
            "returns_pages": capped and on_nvme and not plan.keeps_heap}


# A heap that gives its freed pages back faults every layer's buffers in again: the kernel zeroing them took a fifth
# of gpt2-large's samples at 11 GiB, where the same placement stepped 12.15 s returning them against 10.37 s keeping
# them (docs/engine.md, "Memory"), 1.17x; llama-1b at 12 and 16 GiB stepped 1.17-1.18x their predictions with the
# pages kept (docs/BENCHMARKS.md, "Memory first"). It slows compute and the I/O threads alike.
PAGES_RETURNED_FACTOR = 1.18


def compute_factor(choice: dict | None, recompute: float) -> float:
    """The factor the engine's choices (`engine_choice`) put on compute alone: ``recompute``
    (`zinfjax.planning.calibrate.recompute_factor`) where the forward runs again, `PAGES_RETURNED_FACTOR` where freed
    pages go back.

    Example:
        >>> compute_factor({"recompute": True, "returns_pages": False}, 1.3)
        1.3
        >>> compute_factor(None, 1.3)
        1.0
    """
    if choice is None:
        return 1.0
    return (recompute if choice["recompute"] else 1.0) * (PAGES_RETURNED_FACTOR if choice["returns_pages"] else 1.0)


def predict(config: Config, tiers: dict[str, str], moved: dict[str, float], rates: dict, platform: str,
            factor: float = 1.0, pages: float = 1.0) -> dict:
    """The cost model: the step's compute, host copies and NVMe I/O, and the step they make.

    ``nvme_io_s`` is what the NVMe tier adds to the step: on the CPU backend its I/O path's CPU seconds
    (`io_cpu_rate`), the step never shorter than the disk's own time over the share of it the engine reached
    where the disk bound its timing run (`disk_efficiency`); elsewhere the disk's time. ``factor``: what the
    engine's choices put on compute alone (`compute_factor`); ``pages``: on the host copies and NVMe I/O
    (`PAGES_RETURNED_FACTOR` where freed pages go back).
    """
    alone = rates["reference_s"] if uses_reference(config, tiers) else rates["engine_s"]
    compute = alone * factor
    copy_bw = rates["host_copy_GBps"]  # None: the host tier is device memory and copies nothing
    host = pages * (moved["read_host"] + moved["write_host"]) / (copy_bw * 1e9) if copy_bw else 0.0
    if platform == "cpu":  # copies and the I/O threads take the cores compute uses
        nvme = pages * (moved["read_nvme"] + moved["write_nvme"]) / (rates["nvme_step_GBps"] * 1e9)
        disk = disk_seconds(moved["read_nvme"], moved["write_nvme"], rates) / rates.get("disk_efficiency", 1.0)
        step = max(compute + host + nvme, disk)
    else:
        reading = moved["read_nvme"] / (rates["disk_read_GBps"] * 1e9)
        nvme = reading + moved["write_nvme"] / (rates["disk_write_GBps"] * 1e9)
        step = max(compute, host, nvme)
    return {"compute_alone_s": alone, "compute_s": compute, "host_copy_s": host, "nvme_io_s": nvme, "step_s": step}
