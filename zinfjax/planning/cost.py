"""The cost model: whether a placement fits, the bytes it moves per step, and its predicted step time
(docs/planning.md)."""

from __future__ import annotations

import itertools

from zinfjax._util.choices import TIER_KEYS, TIERS
from zinfjax.config import Config
from zinfjax.engine.budget import COMPILE_RESERVE, LIVE_BASE, LIVE_PER_DEPTH, heap_room, minimum_bytes
from zinfjax.engine.stores import StoreSpec, budget_needs
from zinfjax.planning.state import KIND_TIER, device_bytes

NOMINAL = {"disk_read_GBps": 1.0, "disk_write_GBps": 1.0, "host_copy_GBps": 4.0, "nvme_step_GBps": 1.0,
           "flops_per_s": 2e10}


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


# What each budget regime (`fit`'s ``regime``) costs compute on the CPU backend, against compute alone:
# - least (lean): the backward recomputes each layer's forward (a third more), layers update in parts, one
#   operation is read ahead. Measured on gpt2-large fp32 at memory_limit=5GiB (docs/BENCHMARKS.md, "Memory
#   first"): the lean placement's step less its NVMe time was 1.55x compute alone, the roomy placement's 0.96x.
# - roomy, without the heap's room: freed pages go back to the system and are faulted in again each layer.
#   gpt2-large fp32, the steps of the sweep in docs/BENCHMARKS.md ("Memory first") that ran so, against their
#   predictions at this factor: 1.05x at 5 GiB, 0.97x at 7 GiB; and one placement at 11 GiB, 12.15 s a step
#   against 10.37 s keeping its pages (docs/engine.md, "Memory"), predicted at 1.08x.
# - heap: the roomy budget keeping its freed pages, as the plan's timing runs do.
REGIME_FACTOR = {"least": 1.5, "roomy": 1.3, "heap": 1.0}


def predict(config: Config, tiers: dict[str, str], moved: dict[str, float], rates: dict, platform: str,
            regime: str = "heap") -> dict:
    """The cost model: the step's compute, host copies and NVMe I/O, and the step they make.

    ``nvme_io_s`` is what the NVMe tier adds to the step: on the CPU backend at the rate the engine
    shows (`added_rate`), never less than the disk's own time; elsewhere the disk's time. ``regime``: the engine's
    budget (`fit`); below ``heap`` its compute costs `REGIME_FACTOR` times more.
    """
    alone = rates["reference_s"] if uses_reference(config, tiers) else rates["engine_s"]
    compute = alone * REGIME_FACTOR[regime]
    copy_bw = rates["host_copy_GBps"]  # None: the host tier is device memory and copies nothing
    host = (moved["read_host"] + moved["write_host"]) / (copy_bw * 1e9) if copy_bw else 0.0
    reading = moved["read_nvme"] / (rates["disk_read_GBps"] * 1e9)
    writing = moved["write_nvme"] / (rates["disk_write_GBps"] * 1e9)
    if platform == "cpu":  # copies and the I/O threads take the cores compute uses
        nvme = (moved["read_nvme"] + moved["write_nvme"]) / (rates["nvme_step_GBps"] * 1e9)
        step = max(compute + host + nvme, reading, writing)  # the disk reads and writes at once at best
    else:
        nvme = reading + writing
        step = max(compute, host, nvme)
    return {"compute_alone_s": alone, "compute_s": compute, "host_copy_s": host, "nvme_io_s": nvme, "step_s": step}
