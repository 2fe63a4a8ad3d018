"""``zinfjax plan``: what each part of the training state takes, where it fits, and how fast each placement runs.

For a config (model, batch, precision, stage, mesh) and this machine as it is:

- **bytes** of each part of the state, from the stores the engine would open (`store_specs`, with the
  config's real optimizer through ``jax.eval_shape``): parameters in the compute dtype, fp32 master
  weights (mixed precision), optimizer state, gradients (fp32; stored only where the engine spools
  them), activation checkpoints, and the largest transient of one layer;
- for every placement of params, optimizer, gradients and activations on device, host or nvme (81),
  whether it **fits**: device memory (on the CPU backend the device *is* host memory, so both draw on
  the host budget), the host budget (``memory_limit``, else the memory cgroup or available memory,
  `zinfjax.engine.budget.default_limit`) with the engine's own formula for buffers and read-ahead,
  and the free space under ``nvme_path``;
- a **predicted step time** (the cost model, `predict`):

  ``host = host_bytes / host_copy_bw`` (0 on the CPU backend, where the host tier is device memory and
  copies nothing: `zinfjax.store.layout.host_tier_kind`), ``nvme = nvme_bytes / nvme_step_bw``,
  ``floor = max(nvme_read / disk_read_bw, nvme_write / disk_write_bw)``,
  ``step = max(compute + host + nvme, floor)``

  on the CPU backend, where the NVMe tier's I/O threads (``O_DIRECT`` system
  calls, staging copies, crc32c) take the same cores as compute; the disk's own time is a floor, its
  reads and writes overlapping at best (the engine reads ahead while it writes behind: gpt2-small's
  NVMe step came in at 0.90-0.93x the sum of the two). On an accelerator host copies and disk I/O
  overlap compute, the disk's reads and writes one after the other:
  ``max(compute, host, nvme_read / disk_read_bw + nvme_write / disk_write_bw)``.
  ``compute`` is timed: a few steps of the engine with every tier on device, on the model cut to a
  few layers, scaled to all layers by the layers' share of the FLOPs (the per-layer dispatch overhead
  is in the timed step, so it scales with them). The bytes each store moves per step are counted by
  the same calibration run (reads and writes per byte of each store). ``host_copy_bw`` and
  ``nvme_step_bw`` are what the same few steps with every tier on host, and on nvme (in a scratch
  directory under ``nvme_path``), add to the device-tier step per byte moved: the rates a step
  shows, its overlap included. The disk bandwidths come from a short O_DIRECT probe under
  ``nvme_path`` (`raw_direct_io`).
  A placement with every tier on device at stage 0 trains with the in-memory reference trainer, so
  its compute is timed on that trainer instead.

Without probes (``--no-probe``) the figures are nominal (`NOMINAL`) and the bytes per step come from
the engine's usual pattern (parameters read twice and written once, the rest once each).

Example:
    >>> plan = make_plan(Config(model="gpt2-tiny"), probe=False)
    >>> plan["recommended"]["tiers"]
    {'params': 'device', 'optimizer': 'device', 'gradients': 'device', 'activations': 'device'}
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

from zinfjax import rss
from zinfjax.byte_sizes import format_bytes
from zinfjax.config import Config
from zinfjax.engine.budget import COMPILE_RESERVE, LIVE_BASE, default_limit, minimum_bytes
from zinfjax.engine.store_plan import StoreSpec, budget_needs, spools_gradients, store_specs
from zinfjax.errors import UserError
from zinfjax.store.disk import prepare_directory
from zinfjax.store.layout import host_tier_kind
from zinfjax.vocabulary import COMPUTE_DTYPES, TIER_KEYS, TIERS

MiB = 1 << 20
PROBE_BYTES = 256 * MiB  # the disk probe: 64 MiB swung 2x from run to run on the benchmark machine
CALIBRATION_LAYERS = 4
CALIBRATION_STEPS = 3  # timed, after one untimed step that compiles
NOMINAL = {"disk_read_GBps": 1.0, "disk_write_GBps": 1.0, "host_copy_GBps": 4.0, "nvme_step_GBps": 1.0,
           "flops_per_s": 2e10}
# Which tier key holds each kind of store.
KIND_TIER = {"params": "params", "master": "optimizer", "opt": "optimizer", "grads": "gradients", "acts": "activations"}
# Reads and writes per byte of each kind in one step without probes (grad_accum 1, no gradient clipping).
NOMINAL_TRAFFIC = {"params": (2.0, 1.0), "master": (1.0, 1.0), "opt": (1.0, 1.0), "grads": (1.0, 1.0),
                   "acts": (1.0, 1.0)}


class PlanError(UserError):
    """No placement of the state fits this machine; the message says what is short and by how much."""


# ---- the state's parts -------------------------------------------------------------------------


def _specs(config: Config, model_config) -> tuple[list, dict]:
    """The engine's stores for ``config`` on ``model_config`` as ``(kind, group, like)`` (nothing allocated),
    and the groups it updates in parts (`zinfjax.engine.parts`)."""
    from zinfjax import models
    from zinfjax.engine import compiled
    from zinfjax.engine.parts import update_parts
    from zinfjax.optim import make_optimizer
    from zinfjax.sharding import PERSISTENCE_THRESHOLD, ShardingRules, make_mesh
    from zinfjax.train import lm_program

    compute = COMPUTE_DTYPES[config.precision]
    model = models.build(model_config, compute)
    mesh = make_mesh(config.mesh_axes())
    tx = make_optimizer(config)
    program, _ = lm_program(model, config, tx)
    rules = ShardingRules.for_mesh(mesh, config.stage, model.partition_rules, PERSISTENCE_THRESHOLD)
    layout = compiled(program, tx, rules, mesh, compute, config.grad_accum)
    plan = layout.plan
    specs, acts = store_specs(config, program, plan, layout.placement, compute)
    cut = update_parts(program, plan, specs, spools_gradients(config, plan))
    return [(s.kind, s.group, s.like) for s in specs] + [("acts", s.group, s.like) for s in acts.values()], cut


def tree_bytes(like) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(like))


def device_bytes(like) -> int:
    """Bytes the busiest device holds of a stacked tree: each leaf's shard."""
    total = 0
    for x in jax.tree.leaves(like):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def parameter_count(model_config) -> int:
    from zinfjax import models
    from zinfjax.models.stacked import lm_init

    abstract = jax.eval_shape(lm_init(models.build(model_config)), jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract))


def transient_bytes(config: Config, m) -> int:
    """The largest transient of one layer's forward and backward (float32): MLP and attention scores, or the logits."""
    rows = config.batch_size // config.grad_accum * config.seq_len
    layer = rows * (2 * m.d_ff + 6 * m.d_model) * 4 + config.batch_size // config.grad_accum * m.n_heads \
        * config.seq_len ** 2 * 4 * 2
    head = rows * m.vocab_size * 4 * 2
    return max(layer, head)


def state_parts(config: Config, model_config, stores=None) -> dict:
    """Bytes of each part of the state (whole, and on the busiest device), and the stores behind them."""
    stores = stores if stores is not None else _specs(config, model_config)[0]
    psi = parameter_count(model_config)
    by_kind: dict[str, int] = {}
    per_device: dict[str, int] = {}
    for kind, _, like in stores:
        by_kind[kind] = by_kind.get(kind, 0) + tree_bytes(like)
        per_device[kind] = per_device.get(kind, 0) + device_bytes(like)
    rows = config.batch_size // config.grad_accum * config.seq_len
    itemsize = 2 if config.precision != "fp32" else 4
    return {
        "parameters": psi,
        "params": by_kind.get("params", 0),
        "master": by_kind.get("master", 0),
        "optimizer": by_kind.get("opt", 0),
        "gradients": 4 * psi,  # fp32, what a step produces; stored only where spooled
        "gradients_stored": by_kind.get("grads", 0),
        "activations": by_kind.get("acts", 0),
        "activation_per_layer": config.grad_accum * rows * model_config.d_model * itemsize,
        "activation_transient": transient_bytes(config, model_config),
        "per_device": per_device,
    }


# ---- the machine --------------------------------------------------------------------------------


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def nvme_free(nvme_path: str | None) -> int | None:
    """Free bytes on the filesystem of ``nvme_path`` (or of its nearest existing parent); None without a path."""
    return shutil.disk_usage(_existing(nvme_path)).free if nvme_path else None


def budgets(config: Config) -> dict:
    """The host budget (and its source), the device memory (None on the CPU backend: it is host memory), NVMe."""
    if config.memory_limit:
        host, source = int(config.memory_limit), "memory_limit"
    else:
        host, source = default_limit()
    device = jax.devices()[0]
    device_limit = None
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        device_limit = stats.get("bytes_limit")
    return {"platform": device.platform, "host_bytes": host, "host_source": source, "device_bytes": device_limit,
            "nvme_free_bytes": nvme_free(config.nvme_path), "baseline_bytes": rss.current_bytes()}


def probe_disk(nvme_path: str, nbytes: int = PROBE_BYTES) -> dict:
    """Sequential O_DIRECT write and read bandwidth under ``nvme_path`` (`raw_direct_io`), in GB/s."""
    from zinfjax.store.probe import raw_direct_io

    os.makedirs(nvme_path, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".zinfjax-plan-", dir=nvme_path)
    os.close(fd)
    try:
        out = raw_direct_io(path, nbytes)
    except OSError as e:  # a filesystem without O_DIRECT (tmpfs): the figures stay nominal
        if os.path.exists(path):
            os.remove(path)
        return {"disk_note": f"no O_DIRECT probe ({e.strerror or e}); nominal disk figures"}
    return {"disk_read_GBps": out["raw_read_GBps"], "disk_write_GBps": out["raw_write_GBps"]}


def probe_host_copy(nbytes: int = 8 * MiB, repeats: int = 5) -> float:
    """GB/s of ``device_put`` between device memory and ``pinned_host`` and back, as the host tier copies.

    ``nbytes`` is one copy: the size of one layer's largest leaf, as the tier copies leaf by leaf (the
    rate falls by 2-3x from 8 to 64 MiB on the CPU backend, where a large copy faults in fresh pages).
    """
    from jax.sharding import SingleDeviceSharding

    dev = jax.devices()[0]
    on_device = SingleDeviceSharding(dev, memory_kind="device")
    on_host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    x = jax.device_put(np.ones(nbytes // 4, np.float32), on_device).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = jax.device_put(jax.device_put(x, on_host).block_until_ready(), on_device).block_until_ready()
        times.append(time.perf_counter() - t0)
        del y
    return 2 * nbytes / statistics.median(times) / 1e9


# ---- calibration: compute time and bytes per step -----------------------------------------------


def layer_flops(config: Config, m) -> tuple[float, float]:
    """FLOPs of one step: ``(per layer, the rest)``; forward, recomputed forward and backward (8 x 1 pass)."""
    tokens = config.batch_size * config.seq_len
    kv = m.kv_heads * m.head_dim
    mlp = (3 if m.arch == "llama" else 2) * m.d_model * m.d_ff
    attention = 4 * tokens * config.seq_len * m.d_model
    layer = 2 * tokens * (2 * m.d_model * m.d_model + 2 * m.d_model * kv + mlp) + attention
    rest = 2 * tokens * m.d_model * m.vocab_size
    return 4 * layer, 4 * rest


def calibration_model(model_config, layers: int = CALIBRATION_LAYERS):
    return model_config.replace(n_layers=min(layers, model_config.n_layers))


def calibration_layers(model_config, state_bytes: int, host_bytes: int) -> int:
    """All the layers when the state takes at most a quarter of the host budget; else `CALIBRATION_LAYERS`."""
    return model_config.n_layers if 4 * state_bytes <= host_bytes else CALIBRATION_LAYERS


def _batch(config: Config, vocab: int):
    return np.random.default_rng(0).integers(0, vocab, (config.batch_size, config.seq_len + 1)).astype(np.int32)


def calibrate_engine(config: Config, model_config, layers: int = CALIBRATION_LAYERS, tier: str = "device") -> dict:
    """Times the engine with every tier on ``tier`` on a few layers; counts each store's reads and writes per byte."""
    from zinfjax import models
    from zinfjax.sharding import make_mesh
    from zinfjax.train import lm_engine

    c = config.replace(**dict.fromkeys(TIER_KEYS, tier), tiers="manual", save_dir=None, resume=False,
                       memory_limit=None)
    m = calibration_model(model_config, layers)
    engine = lm_engine(models.build(m, COMPUTE_DTYPES[c.precision]), c, make_mesh(c.mesh_axes()))
    try:
        batch = _batch(c, m.vocab_size)
        engine.train_step(batch)
        named = [(k, g, s) for k, d in engine.stores.stores.items() for g, s in d.items()]
        named += [("acts", f"s:scan{p}", s) for p, s in engine.stores.acts.items()]
        before = {(k, g): (s.stats.bytes_read, s.stats.bytes_written) for k, g, s in named}
        times = []
        for _ in range(CALIBRATION_STEPS):
            times.append(engine.train_step(batch)["step_s"])
        traffic = {}
        for k, g, s in named:
            size = s.layer_nbytes * s.num_layers
            r0, w0 = before[(k, g)]
            n = CALIBRATION_STEPS * max(size, 1)
            traffic[f"{k}|{g}"] = ((s.stats.bytes_read - r0) / n, (s.stats.bytes_written - w0) / n)
    finally:
        engine.close()
    moved = sum(s.stats.bytes_read - before[(k, g)][0] + s.stats.bytes_written - before[(k, g)][1]
                for k, g, s in named) / CALIBRATION_STEPS
    return {"step_s": statistics.median(times), "layers": m.n_layers, "traffic": traffic, "bytes_per_step": moved}


def added_rate(device: dict, tier: dict, floor: float) -> float:
    """GB/s a tier adds to the step per byte it moves: that tier's step over the device-tier step, per byte.

    The engine's copies and I/O overlap its compute in part, so this effective rate is what predicts
    a step; when the difference is lost in noise, ``floor`` (a bare copy's or the disk's rate) stands
    in, or the rate that would add 2% to the step if that is higher.

    Example:
        >>> added_rate({"step_s": 1.0}, {"step_s": 1.5, "bytes_per_step": 1e9}, 1.0)
        2.0
    """
    extra = tier["step_s"] - device["step_s"]
    if extra <= 0.02 * device["step_s"] or tier["bytes_per_step"] <= 0:
        return max(floor, tier["bytes_per_step"] / max(0.02 * device["step_s"], 1e-9) / 1e9)
    return tier["bytes_per_step"] / extra / 1e9


def calibrate_nvme(config: Config, model_config, layers: int) -> dict:
    """`calibrate_engine` with every tier on nvme, in a scratch directory under ``nvme_path`` removed after."""
    os.makedirs(config.nvme_path, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".zinfjax-plan-", dir=config.nvme_path)
    try:
        return calibrate_engine(config.replace(nvme_path=scratch), model_config, layers, tier="nvme")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def calibrate_reference(config: Config, model_config, layers: int = CALIBRATION_LAYERS) -> float:
    """Median step time of the in-memory reference trainer (every tier on device, stage 0) on a few layers."""
    from zinfjax import models
    from zinfjax.sharding import make_mesh
    from zinfjax.train import ReferenceTrainer

    m = calibration_model(model_config, layers)
    trainer = ReferenceTrainer(config, models.build(m, COMPUTE_DTYPES[config.precision]), make_mesh(config.mesh_axes()))
    batch = _batch(config, m.vocab_size)
    trainer.step(batch)
    times = []
    for _ in range(CALIBRATION_STEPS):
        t0 = time.perf_counter()
        trainer.step(batch)  # float(loss) waits for the step
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scale_to_model(seconds: float, config: Config, model_config, layers: int) -> float:
    """A step timed on ``layers`` layers, scaled to all of them by FLOPs."""
    per_layer, rest = layer_flops(config, model_config)
    return seconds * (rest + model_config.n_layers * per_layer) / (rest + layers * per_layer)


def nominal_compute(config: Config, model_config) -> float:
    per_layer, rest = layer_flops(config, model_config)
    return (rest + model_config.n_layers * per_layer) / NOMINAL["flops_per_s"]


# ---- placements ---------------------------------------------------------------------------------


def placements(nvme: bool) -> list[dict[str, str]]:
    """Every assignment of the four tier keys to device, host and (with an nvme_path) nvme."""
    tiers = TIERS if nvme else tuple(t for t in TIERS if t != "nvme")
    return [dict(zip(TIER_KEYS, combo, strict=True)) for combo in itertools.product(tiers, repeat=4)]


def uses_reference(config: Config, tiers: dict[str, str]) -> bool:
    """``zinfjax train`` runs this placement on the in-memory reference trainer (see `zinfjax.train.uses_engine`)."""
    return config.stage == 0 and not config.save_dir and all(t == "device" for t in tiers.values())


def fit(config: Config, parts: dict, stores, tiers: dict[str, str], machine: dict, cut: dict | None = None) -> dict:
    """What ``tiers`` needs of host memory, device memory and disk, and what is short of each
    (``cut``: the groups the engine updates in parts)."""
    cpu = machine["platform"] == "cpu"
    held = {"device": 0, "host": 0, "nvme": 0}
    device_held = 0
    specs = []
    for kind, group, like in stores:
        tier = tiers[KIND_TIER[kind]]
        held[tier] += tree_bytes(like)
        if tier == "device":
            device_held += device_bytes(like)
        specs.append(StoreSpec(kind, group, tier, like))
    read, write_slice, _ = budget_needs([s for s in specs if s.kind != "acts"], [s for s in specs if s.kind == "acts"],
                                        machine["platform"], cut)
    transient = parts["activation_transient"]
    if uses_reference(config, tiers):  # the whole state, the gradients and the activations at once
        resident = held["device"] + parts["gradients"] + parts["activations"]
        host_need = machine["baseline_bytes"] + resident + transient + COMPILE_RESERVE
    else:  # the engine's budget (zinfjax.engine.budget.plan_budget), and one layer's transient
        resident = held["host"] + (held["device"] if cpu else 0)
        host_need = minimum_bytes(machine["baseline_bytes"], resident, read, write_slice) + transient
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
        n = tree_bytes(like)
        tier = tiers[KIND_TIER[kind]]
        r, w = factors.get(tier, factors.get("device", {})).get(f"{kind}|{group}") or NOMINAL_TRAFFIC[kind]
        out[f"read_{tier}"] += r * n
        out[f"write_{tier}"] += w * n
    return out


def predict(config: Config, tiers: dict[str, str], moved: dict[str, float], rates: dict, platform: str) -> dict:
    """The cost model: the step's compute, host copies and NVMe I/O, and the step they make.

    ``nvme_io_s`` is what the NVMe tier adds to the step: on the CPU backend at the rate the engine
    shows (`added_rate`), never less than the disk's own time; elsewhere the disk's time.
    """
    compute = rates["reference_s"] if uses_reference(config, tiers) else rates["engine_s"]
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
    return {"compute_s": compute, "host_copy_s": host, "nvme_io_s": nvme, "step_s": step}


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
        if any(f["fits"] and uses_reference(config, t) for t, f in fits):
            rates["reference_s"] = scale_to_model(calibrate_reference(config, model_config, layers), config,
                                                  model_config, calibration["layers"])
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


def _rate(gbps: float | None) -> str:
    return "none" if gbps is None else f"{gbps:.2f} GB/s"


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


def format_plan(plan: dict, top: int = 12) -> str:
    """The plan as a readable table: the parts, the machine, and the fastest placements that fit."""
    p, m, r = plan["parts"], plan["machine"], plan["rates"]
    lines = [f"model {plan['model']}: {p['parameters']:,} parameters, batch {plan['batch_size']} x {plan['seq_len']}, "
             f"{plan['precision']}, stage {plan['stage']}, mesh {plan['mesh']}", "", "state:"]
    for key, label in (("params", f"params ({plan['precision']})"), ("master", "fp32 master"),
                       ("optimizer", "optimizer state"), ("gradients", "gradients (fp32)"),
                       ("activations", "activation checkpoints"), ("activation_transient", "largest transient")):
        if key == "master" and not p["master"]:
            continue
        extra = ""
        if key == "gradients":
            extra = f"  (stored: {format_bytes(p['gradients_stored'])}; the rest is applied as it is made)"
        if key == "activations":
            extra = f"  ({format_bytes(p['activation_per_layer'])} per layer)"
        lines.append(f"  {label:<24}{format_bytes(p[key]):>12}{extra}")
    nvme = "not set" if m["nvme_free_bytes"] is None else f"{format_bytes(m['nvme_free_bytes'])} free"
    device = "= host memory (CPU backend)" if m["device_bytes"] is None else format_bytes(m["device_bytes"])
    lines += ["", f"machine: host budget {format_bytes(m['host_bytes'])} ({m['host_source']}), device {device}, "
              f"nvme {nvme}",
              f"rates{'' if plan['probed'] else ' (nominal)'}: compute {r['engine_s']:.3f} s/step (engine), "
              f"{r['reference_s']:.3f} s/step (in-memory), host copy {_rate(r['host_copy_GBps'])}, "
              f"disk read {r['disk_read_GBps']:.2f} / write {r['disk_write_GBps']:.2f} GB/s, nvme tier in a step "
              f"{r['nvme_step_GBps']:.2f} GB/s", ""]
    header = f"{'params':<8}{'optimizer':<10}{'gradients':<10}{'activations':<12}{'fits':<6}{'step s':>8}" \
             f"{'compute':>9}{'host':>8}{'nvme':>8}  short"
    lines.append(header)
    shown = [row for row in plan["placements"] if row["fits"]][:top]
    shown += [row for row in plan["placements"] if not row["fits"]][:max(0, top - len(shown))]
    for row in shown:
        t = row["tiers"]
        short = ", ".join(f"{k} {format_bytes(v)}" for k, v in row["short"].items())
        lines.append(f"{t['params']:<8}{t['optimizer']:<10}{t['gradients']:<10}{t['activations']:<12}"
                     f"{'yes' if row['fits'] else 'no':<6}{row['step_s']:>8.3f}{row['compute_s']:>9.3f}"
                     f"{row['host_copy_s']:>8.3f}{row['nvme_io_s']:>8.3f}  {short}")
    more = len(plan["placements"]) - len(shown)
    if more:
        lines.append(f"... {more} more placements (--all shows them, --json gives every figure)")
    rec = plan["recommended"]
    lines += ["", "recommended: " + " ".join(f"params={rec['tiers']['params']} optimizer={rec['tiers']['optimizer']} "
                                              f"gradients={rec['tiers']['gradients']} "
                                              f"activations={rec['tiers']['activations']}".split())
              + f" (predicted {rec['step_s']:.3f} s/step; zinfjax train --set tiers=auto uses it)"]
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)
