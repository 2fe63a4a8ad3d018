"""The plan: every placement of the state, whether it fits, its predicted step, and the one to take.

For a config and this machine as it is, `make_plan` sizes each part of the state (`state`), probes the disk and
host copies (`probes`), times a few steps of the engine on a cut model (`calibrate`), and predicts each of the 81
placements' step (`cost`); `resolve_auto` takes the fastest that fits for ``tiers=auto``. The cost model is
specified in docs/planning.md.

Example:
    >>> plan = make_plan(Config(model="gpt2-tiny"), probe=False)
    >>> plan["recommended"]["tiers"]
    {'params': 'device', 'optimizer': 'device', 'gradients': 'device', 'activations': 'device'}
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np

from zinfjax._util.byte_sizes import format_bytes
from zinfjax._util.choices import TIER_KEYS
from zinfjax.checkpoint.model import resolve_model
from zinfjax.config import Config
from zinfjax.engine.budget import MemoryBudgetError
from zinfjax.errors import UserError
from zinfjax.planning.calibrate import (
    added_rate,
    calibrate_engine,
    calibrate_nvme,
    calibrate_reference,
    calibration_layers,
    disk_efficiency,
    io_cpu_rate,
    nominal_compute,
    recompute_factor,
    scale_to_model,
)
from zinfjax.planning.cost import (
    NOMINAL,
    PAGES_RETURNED_FACTOR,
    compute_factor,
    engine_choice,
    fit,
    placements,
    predict,
    traffic,
    uses_reference,
)
from zinfjax.planning.fill import fill_memory
from zinfjax.planning.probes import MiB, probe_disk, probe_host_copy
from zinfjax.planning.state import _specs, budgets, state_parts
from zinfjax.runtime import rss
from zinfjax.runtime.allocator import tune_allocator
from zinfjax.runtime.cpu_load import OtherLoad
from zinfjax.store.disk import prepare_directory
from zinfjax.store.layout import host_tier_kind


class PlanError(UserError):
    """No placement of the state fits this machine; the message says what is short and by how much."""


# ---- the state's parts -------------------------------------------------------------------------


# ---- the machine --------------------------------------------------------------------------------


# ---- calibration: compute time and bytes per step -----------------------------------------------


# ---- placements ---------------------------------------------------------------------------------


OFFLOAD_ORDER = {"device": 0, "host": 1, "nvme": 2}
REGIMES = ("heap", "roomy", "least")  # the engine's budget regimes, roomiest first (`zinfjax.planning.cost.fit`)
TIE = 0.1  # predictions this close count as equal: the placement that offloads less wins


def make_plan(config: Config, probe: bool = True, baseline: int | None = None) -> dict:
    """The plan for ``config`` on this machine; raises `PlanError` when no placement fits. ``baseline``: what the
    process that will train holds already (default: this one's resident memory).

    Example:
        >>> make_plan(Config(model="gpt2-tiny"), probe=False)["parts"]["params"]  # fp32 bytes
        898560
    """
    config = config.with_batch_for(_data_size(config))
    model_config = resolve_model(config.model)
    _check_batch(config, model_config)
    model_config = plan_tiles(config, model_config)
    machine = budgets(config, baseline)
    stores, cut, residuals = _specs(config, model_config)
    parts = {**state_parts(config, model_config, stores), "residuals": residuals}
    candidates = placements(nvme=bool(config.nvme_path))
    for regime in REGIMES if config.nvme_path else ():  # memory first, leaving the engine each budget regime
        filled = fill_memory(config, parts, stores, machine, cut, regime=regime)
        if filled is not None and filled not in candidates:
            candidates.append(filled)
    fits = [(tiers, fit(config, parts, stores, tiers, machine, cut)) for tiers in candidates]
    if not any(f["fits"] for _, f in fits):
        raise PlanError(shortfall(config, fits, machine))
    rates = dict(NOMINAL, engine_s=nominal_compute(config, model_config))
    rates["reference_s"] = rates["engine_s"]
    factors, notes = None, []
    host_kind, no_copy = host_tier_kind(jax.devices()[0], config.update_on == "host")
    copies = host_kind != "device"
    if not copies:
        rates["host_copy_GBps"] = None
        notes.append(f"the host tier copies nothing: {no_copy}")
    if probe:
        factors = _measure(config, model_config, stores, parts, machine, rates, copies,
                           any(f["fits"] and uses_reference(config, t) for t, f in fits))
    else:
        notes.append("no probes: nominal disk, host-copy and compute figures")
    for note in ("disk_note", "calibration_note"):
        if note in rates:
            notes.append(rates.pop(note))
    if busy_note(rates):
        notes.append(busy_note(rates))
    recompute = recompute_factor(config, model_config)
    rows = [_row(config, tiers, f, traffic(stores, tiers, factors), rates, machine,
                 engine_choice(config, parts, stores, tiers, machine, cut), recompute) for tiers, f in fits]
    rows.sort(key=lambda r: (not r["fits"], round(r["step_s"], 4), offloaded(r["tiers"])))
    best = recommend(rows)
    if machine["platform"] == "cpu":
        notes.append("CPU backend: device memory is host memory, so the device and host tiers share the host budget")
    if not config.nvme_path:
        notes.append("nvme_path is not set: placements on nvme are not considered")
    return {"model": config.model, "batch_size": config.batch_size, "seq_len": config.seq_len,
            "precision": config.precision, "stage": config.stage, "mesh": config.mesh, "parts": parts,
            "machine": machine, "rates": rates, "probed": probe, "notes": notes,
            "tiles": model_config.tiles,
            "recommended": {"tiers": best["tiers"], "step_s": best["step_s"], "regime": best["regime"],
                            "engine": best["engine"]},
            "placements": rows}


def regime_of(choice: dict | None) -> str:
    """The budget regime (`zinfjax.planning.cost.fit`) of the engine's choice for a placement
    (`zinfjax.planning.cost.engine_choice`): ``least`` where lean or refused, ``roomy`` where its freed pages go
    back, else ``heap``.

    Example:
        >>> regime_of({"lean": False, "returns_pages": True}), regime_of(None)
        ('roomy', 'least')
    """
    if choice is None or choice["lean"]:
        return "least"
    return "roomy" if choice["returns_pages"] else "heap"


def _row(config: Config, tiers: dict, f: dict, moved: dict, rates: dict, machine: dict, choice: dict | None,
         recompute: float) -> dict:
    """One placement's row: its fit, bytes per step, the engine's choice for it (`engine_choice`) and predicted step;
    on the engine's path on the CPU backend, what the engine chooses costs compute (`zinfjax.planning.cost.predict`)."""
    engine = machine["platform"] == "cpu" and not uses_reference(config, tiers)
    factor = compute_factor(choice, recompute) if engine else 1.0
    pages = PAGES_RETURNED_FACTOR if engine and choice and choice["returns_pages"] else 1.0
    regime = regime_of(choice)
    return {"tiers": tiers, "fits": f["fits"], "need": f["need"], "short": f["short"], "bytes_per_step": moved,
            "roomy": regime != "least", "regime": regime, "engine": choice,
            **predict(config, tiers, moved, rates, machine["platform"], factor, pages)}


def plan_tiles(config: Config, model_config):
    """The model the placements are planned for, tiles first: the count ``tiles`` gives, or for ``tiles=auto`` the
    fewest whose largest operation fits the budget with the state where it takes least memory (every part on NVMe,
    with an ``nvme_path``; `zinfjax.trainers.streaming.choose_tiles`). The placement gets what is left."""
    if config.tiles != "auto":
        return model_config.replace(tiles=int(config.tiles))
    if config.lora_rank:  # adapters run in untiled blocks (models/lora.py)
        return model_config
    from zinfjax.sharding import make_mesh
    from zinfjax.trainers.streaming import choose_tiles

    least = config.replace(**dict.fromkeys(TIER_KEYS, "nvme"), tiers="manual") if config.nvme_path else config
    try:
        return choose_tiles(model_config, least, make_mesh(config.mesh_axes()))
    except MemoryBudgetError:  # no count fits: the placements' fits say what is short
        return model_config


def _measure(config: Config, model_config, stores, parts: dict, machine: dict, rates: dict, copies: bool,
             reference: bool) -> dict:
    """Probes the disk and host copies and times the engine on a cut model, into ``rates``; returns the bytes
    each kind of store moves per byte of it in a step (per tier). ``reference``: time the in-memory trainer too."""
    if config.nvme_path:  # the probes write under it: a path that cannot hold them is refused in one line
        prepare_directory(config.nvme_path)
    largest = max((math.prod(x.shape[1:]) * np.dtype(x.dtype).itemsize for _, _, like in stores
                   for x in jax.tree.leaves(like)), default=MiB)
    if copies:
        rates["host_copy_GBps"] = probe_host_copy(int(min(max(largest, MiB), 64 * MiB)))
    if config.nvme_path:
        rates.update(probe_disk(config.nvme_path))
    state = parts["params"] + parts["master"] + parts["optimizer"] + parts["gradients"]
    layers = calibration_layers(model_config, state, machine["host_bytes"])
    saved = dict(rates)
    try:
        with OtherLoad() as load:
            factors = _calibrate(config, model_config, layers, rates, copies, reference, machine)
    except MemoryBudgetError as e:  # a budget too small for the timed runs still gets a plan: nominal compute
        rates.clear()
        rates.update(saved, calibration_note=f"the timing runs did not fit this budget ({e}); compute and the "
                     "NVMe tier's rate in a step are nominal")
        return None
    rates["other_cpu_cores"] = load.cores
    return factors


BUSY_CORES = 0.25  # other processes' load during calibration worth a warning: a quarter of a core


def busy_note(rates: dict) -> str | None:
    """A warning when other processes kept the machine busy while the plan timed its steps, or None.

    Example:
        >>> busy_note({"other_cpu_cores": 1.6})[:52]
        'other processes kept 1.60 cores busy while the plan '
    """
    cores = rates.get("other_cpu_cores", 0.0)
    if cores < BUSY_CORES:
        return None
    return (f"other processes kept {cores:.2f} cores busy while the plan timed its steps (this machine has "
            f"{os.cpu_count()}): the predicted steps are those of a shared machine, slower than this one alone, and "
            "the placement may differ from the one it would choose idle; plan again when it is idle")


def _calibrate(config: Config, model_config, layers: int, rates: dict, copies: bool, reference: bool,
               machine: dict) -> dict:
    """The timed runs of `_measure`, into ``rates``; returns the bytes per byte each store moves, by tier."""
    calibration = calibrate_engine(config, model_config, layers)
    factors = {"device": calibration["traffic"]}
    if copies:
        on_host = calibrate_engine(config, model_config, calibration["layers"], tier="host")
        rates["host_copy_GBps"] = added_rate(calibration, on_host, rates["host_copy_GBps"])
    if config.nvme_path and machine["platform"] == "cpu":  # only the CPU backend's model uses it
        on_nvme = calibrate_nvme(config, model_config, calibration["layers"])
        factors["nvme"] = on_nvme["traffic"]
        disk = 2 / (1 / rates["disk_read_GBps"] + 1 / rates["disk_write_GBps"])
        rates["nvme_step_GBps"] = io_cpu_rate(calibration, on_nvme, disk)
        rates["disk_efficiency"] = disk_efficiency(calibration, on_nvme, rates)
    rates["engine_s"] = scale_to_model(calibration["step_s"], config, model_config, calibration["layers"])
    rates["calibration_slowed"] = calibration["slowed"]
    rates["calibration_layers"] = calibration["layers"]
    if reference:
        rates["reference_s"] = scale_to_model(calibrate_reference(config, model_config, layers), config,
                                              model_config, calibration["layers"])
    return factors


def recommend(rows: list[dict], within: float = TIE) -> dict:
    """The fastest placement that fits; among those within ``within`` of it (and, where the fastest's engine keeps
    its heap's pages, among those that keep them too), the one that moves the fewest bytes on NVMe, and of those
    the one that offloads least.

    A prediction is not exact to a few percent, and offloading what need not be costs memory
    traffic for nothing: the disk's bytes first, which bound a step on NVMe (docs/planning.md). A
    placement whose engine must give back its pages is no tie for one that need not: at
    gpt2-large's 9 GiB one predicted 9% slower that gave its pages back was taken for its fewer bytes,
    and measured slower than the 7 GiB step.

    Example:
        >>> row = lambda s, regime, gb: {"fits": True, "step_s": s, "regime": regime, "tiers": {},
        ...                              "bytes_per_step": {"read_nvme": gb * 1e9, "write_nvme": 0.0}}
        >>> recommend([row(10.8, "heap", 10.4), row(11.8, "roomy", 7.9)])["step_s"]
        10.8
        >>> recommend([row(10.8, "heap", 10.4), row(11.4, "heap", 9.0)])["step_s"]
        11.4
    """
    fitting = [r for r in rows if r["fits"]]
    best = min(fitting, key=lambda r: r["step_s"])
    heap = best.get("regime") == "heap"  # rows of `zinfjax plan --machine` have no engine choice
    close = [r for r in fitting if r["step_s"] <= (1 + within) * best["step_s"] and (not heap or r["regime"] == "heap")]
    return min(close, key=lambda r: (round(nvme_bytes(r)), offloaded(r["tiers"]), r["step_s"]))


def nvme_bytes(row: dict) -> float:
    """The bytes a placement's step reads from and writes to NVMe."""
    moved = row["bytes_per_step"]
    return moved["read_nvme"] + moved["write_nvme"]


def offloaded(tiers: dict[str, str]) -> float:
    """How far a placement offloads: device 0, host 1, nvme 2 per tier key, a split of host and nvme between."""
    return sum(OFFLOAD_ORDER.get(t, 1.5) for t in tiers.values())


def _data_size(config: Config) -> int:
    from zinfjax.sharding import make_mesh

    return make_mesh(config.mesh_axes()).shape["data"]


def _check_batch(config: Config, model_config) -> None:
    from zinfjax.errors import ConfigError
    from zinfjax.sharding import check_batch, make_mesh

    check_batch(config.batch_size, make_mesh(config.mesh_axes()), config.grad_accum)
    if config.seq_len > model_config.max_seq_len:
        raise ConfigError(f"seq_len={config.seq_len} exceeds the model's context of {model_config.max_seq_len}")


def shortfall(config: Config, fits: list, machine: dict) -> str:
    """One line: the placement that comes closest to fitting, and what it lacks."""
    def lack(f):
        return sum(f["short"].values())

    tiers, f = min(fits, key=lambda tf: lack(tf[1]))
    names = {"host": f"host memory ({machine['host_source']})", "device": "device memory",
             "nvme": f"free space under nvme_path {config.nvme_path}"}
    what = "; ".join(f"{names[k]} is short by {format_bytes(v)} (needs {format_bytes(f['need'][k])}, has "
                     f"{format_bytes(f['have'][k])})" for k, v in f["short"].items())
    place = ", ".join(f"{k}={v}" for k, v in tiers.items())
    hint = "" if config.nvme_path else "; set nvme_path to consider the nvme tier"
    return f"{config.model} fits no placement; the closest ({place}): {what}{hint}"


def resolve_auto(config: Config, probe: bool = True, isolated: bool = False) -> tuple[Config, dict]:
    """``config`` with ``tiers=auto`` replaced by the recommended tiers (and ``tiers=manual``).

    ``isolated``: plan in a child process (`plan_apart`), so that what the calibration runs leave in memory (their
    compiled functions, their heap) is not the run's: the budget the plan fits is then the run's too.
    """
    plan = plan_apart(config, probe) if isolated else make_plan(config, probe=probe)
    tiles = {"tiles": str(plan["tiles"])} if config.tiles == "auto" and not config.lora_rank else {}
    return config.replace(**plan["recommended"]["tiers"], tiers="manual", **tiles), plan


def plan_apart(config: Config, probe: bool = True) -> dict:
    """`make_plan` in a child Python process; its `UserError` raised here as a `PlanError` with the same message."""
    code = "import sys; from zinfjax.planning.recommend import _plan_child; _plan_child(*sys.argv[1:])"
    argv = [sys.executable, "-c", code, "1" if probe else "0", str(rss.current_bytes())]  # this process's memory
    child = subprocess.run(argv, input=json.dumps(config.to_dict()), capture_output=True, text=True)
    sys.stderr.write(child.stderr)
    try:
        out = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"the planning process failed (exit {child.returncode}): {child.stderr[-2000:]}") from None
    if "error" in out:
        raise PlanError(out["error"])
    return out


def _plan_child(probe: str, baseline: str) -> None:
    """The child of `plan_apart`: a config on stdin, the plan (or ``{"error": message}``) as one JSON line, fitted to
    the parent's ``baseline`` memory."""
    config = Config.from_dict(json.loads(sys.stdin.read()))
    if config.may_use_nvme:  # its timing runs on the heap the run will have (`zinfjax train` tunes it so)
        tune_allocator()
    try:
        out = make_plan(config, probe=probe == "1", baseline=int(baseline))
    except UserError as e:
        out = {"error": str(e)}
    print(json.dumps(out, default=str))


# ---- output -------------------------------------------------------------------------------------


