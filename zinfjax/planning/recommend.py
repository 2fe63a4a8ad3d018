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

import math

import jax
import numpy as np

from zinfjax._util.byte_sizes import format_bytes
from zinfjax.config import Config
from zinfjax.errors import UserError
from zinfjax.planning.calibrate import (
    added_rate,
    calibrate_engine,
    calibrate_nvme,
    calibrate_reference,
    calibration_layers,
    nominal_compute,
    scale_to_model,
)
from zinfjax.planning.cost import NOMINAL, fit, placements, predict, traffic, uses_reference
from zinfjax.planning.probes import MiB, probe_disk, probe_host_copy
from zinfjax.planning.state import _specs, budgets, state_parts
from zinfjax.store.disk import prepare_directory
from zinfjax.store.layout import host_tier_kind


class PlanError(UserError):
    """No placement of the state fits this machine; the message says what is short and by how much."""


# ---- the state's parts -------------------------------------------------------------------------


# ---- the machine --------------------------------------------------------------------------------


# ---- calibration: compute time and bytes per step -----------------------------------------------


# ---- placements ---------------------------------------------------------------------------------


OFFLOAD_ORDER = {"device": 0, "host": 1, "nvme": 2}
TIE = 0.1  # predictions this close count as equal: the placement that offloads less wins


def make_plan(config: Config, probe: bool = True) -> dict:
    """The plan for ``config`` on this machine; raises `PlanError` when no placement fits.

    Example:
        >>> make_plan(Config(model="gpt2-tiny"), probe=False)["parts"]["params"]  # fp32 bytes
        898560
    """
    from zinfjax import models

    config = config.with_batch_for(_data_size(config))
    model_config = models.ModelConfig.resolve(config.model)
    _check_batch(config, model_config)
    machine = budgets(config)
    stores, cut = _specs(config, model_config)
    parts = state_parts(config, model_config, stores)
    candidates = placements(nvme=bool(config.nvme_path))
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
    if "disk_note" in rates:
        notes.append(rates.pop("disk_note"))
    rows = []
    for tiers, f in fits:
        moved = traffic(stores, tiers, factors)
        rows.append({"tiers": tiers, "fits": f["fits"], "need": f["need"], "short": f["short"], "bytes_per_step": moved,
                     **predict(config, tiers, moved, rates, machine["platform"])})
    rows.sort(key=lambda r: (not r["fits"], round(r["step_s"], 4), sum(OFFLOAD_ORDER[t] for t in r["tiers"].values())))
    best = recommend(rows)
    if machine["platform"] == "cpu":
        notes.append("CPU backend: device memory is host memory, so the device and host tiers share the host budget")
    if not config.nvme_path:
        notes.append("nvme_path is not set: placements on nvme are not considered")
    return {"model": config.model, "batch_size": config.batch_size, "seq_len": config.seq_len,
            "precision": config.precision, "stage": config.stage, "mesh": config.mesh, "parts": parts,
            "machine": machine, "rates": rates, "probed": probe, "notes": notes,
            "recommended": {"tiers": best["tiers"], "step_s": best["step_s"]}, "placements": rows}


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
    calibration = calibrate_engine(config, model_config, layers)
    factors = {"device": calibration["traffic"]}
    if copies:
        on_host = calibrate_engine(config, model_config, calibration["layers"], tier="host")
        rates["host_copy_GBps"] = added_rate(calibration, on_host, rates["host_copy_GBps"])
    if config.nvme_path and machine["platform"] == "cpu":  # only the CPU backend's model uses it
        on_nvme = calibrate_nvme(config, model_config, calibration["layers"])
        factors["nvme"] = on_nvme["traffic"]
        disk = 2 / (1 / rates["disk_read_GBps"] + 1 / rates["disk_write_GBps"])
        rates["nvme_step_GBps"] = added_rate(calibration, on_nvme, disk)
    rates["engine_s"] = scale_to_model(calibration["step_s"], config, model_config, calibration["layers"])
    rates["calibration_layers"] = calibration["layers"]
    if reference:
        rates["reference_s"] = scale_to_model(calibrate_reference(config, model_config, layers), config,
                                              model_config, calibration["layers"])
    return factors


def recommend(rows: list[dict], within: float = TIE) -> dict:
    """The fastest placement that fits; among those within ``within`` of it, the one that offloads least.

    A prediction is not exact to a few percent, and offloading what need not be costs memory
    traffic for nothing.
    """
    fitting = [r for r in rows if r["fits"]]
    fastest = min(r["step_s"] for r in fitting)
    close = [r for r in fitting if r["step_s"] <= (1 + within) * fastest]
    return min(close, key=lambda r: (sum(OFFLOAD_ORDER[t] for t in r["tiers"].values()), r["step_s"]))


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


def resolve_auto(config: Config, probe: bool = True) -> tuple[Config, dict]:
    """``config`` with ``tiers=auto`` replaced by the recommended tiers (and ``tiers=manual``)."""
    plan = make_plan(config, probe=probe)
    return config.replace(**plan["recommended"]["tiers"], tiers="manual"), plan


# ---- output -------------------------------------------------------------------------------------


