"""``zinfjax plan --machine``: the plan for a machine described in a file, from the model's shapes alone.

For a config (model, batch, precision, stage) and a `Machine` (`zinfjax.planning.machine`): the model
states and activation checkpoints by kind (`zinfjax.planning.scale`), each device's working memory the
ZeRO-Infinity paper's way and zinfjax's way with the tile count it would pick, which placements of
params, optimizer, gradients and activations on device, host or NVMe fit how many nodes, the fewest
nodes of each placement class (ZeRO-3, ZeRO-Offload, ZeRO-Infinity), and each placement's predicted
step through the local plan's cost model (`zinfjax.planning.cost.predict`). docs/planning.md,
"Planning for another machine", holds the formulas.

Example:
    >>> plan = plan_for_machine(Config(model="gpt2-small", precision="bf16", stage=3), load_machine(
    ...     "examples/machines/h100-8x.yaml"))
    >>> plan["nodes"], plan["recommended"]["tiers"]["params"]
    (1, 'device')
"""

from __future__ import annotations

from zinfjax._util.byte_sizes import format_bytes
from zinfjax._util.choices import TIER_KEYS
from zinfjax.checkpoint.model import resolve_model
from zinfjax.config import Config
from zinfjax.errors import ConfigError
from zinfjax.models.configs import tile_counts
from zinfjax.planning.cost import NOMINAL_TRAFFIC, placements, predict
from zinfjax.planning.machine import Machine, load_machine
from zinfjax.planning.recommend import PlanError, recommend
from zinfjax.planning.scale import (
    activation_checkpoint_bytes,
    largest_matrix,
    largest_unit,
    optimizer_slots,
    paper_working_memory,
    parameter_count,
    pick_tiles,
    state_bytes,
)
from zinfjax.planning.state import KIND_TIER

__all__ = ["load_machine", "plan_for_machine"]

# A device's working memory (the largest streamed unit, its gradients and its activations) may take at
# most this fraction of its memory. The rest holds what runs beside it: the next unit read ahead (the
# engine's read-ahead is at least one unit deep, so a second unit of the same size), the ZeRO-3 shards
# the all-gather assembles the unit from, the device-tier state and activation checkpoints, and what the
# allocator loses to fragmentation (the ZeRO paper saw out-of-memory errors with 30% of memory free).
WORKING_FRACTION = 0.5

# FLOPs per parameter per token of a step: forward 2, the forward rerun for activation checkpointing
# 2, backward 4 (the paper's 2 x 4 x bsz x seq x params). Without recomputation it would be 6.
FLOPS_PER_PARAM_TOKEN = 8

MAX_NODES = 10**7  # the node counts searched for a placement that fits
STATE_OF_KIND = {"params": "params", "master": "master", "opt": "optimizer", "grads": "gradients"}
# The placement classes, each the placements a DeepSpeed user knows by that name: ZeRO-3 keeps every part on
# the devices; ZeRO-Offload keeps the optimizer (its state and update) in host memory and nothing on NVMe;
# ZeRO-Infinity offloads the optimizer too and puts it or the parameters on NVMe. So a class shows its own kind
# of placement even where the devices alone hold everything.
CLASSES = (
    ("GPU only (ZeRO-3)", lambda t: set(t.values()) == {"device"}),
    ("GPU+CPU (ZeRO-Offload)", lambda t: t["optimizer"] == "host" and "nvme" not in t.values()),
    ("GPU+CPU+NVMe (ZeRO-Infinity)", lambda t: t["optimizer"] != "device" and "nvme" in (t["params"], t["optimizer"])),
)


def plan_for_machine(config: Config, machine: Machine, nodes: int | None = None) -> dict:
    """The plan for ``config`` on ``machine``, with at most ``nodes`` nodes (default: the file's ``nodes``).

    It is made on the fewest nodes any placement fits. Raises `PlanError` with what is short, and by how
    much, when none fits within the limit.
    """
    limit = nodes or machine.nodes
    m = _model(config)
    s = _Setting(config, m, machine)
    candidates = placements(nvme=machine.nvme_capacity > 0)
    least = {_key(t): s.fewest_nodes(t, limit) for t in candidates}
    fitting = [n for n in least.values() if n is not None]
    if not fitting:
        raise PlanError(s.shortfall(candidates, least, limit))
    n = min(fitting)
    rows = [s.row(t, n) for t in candidates]
    rows.sort(key=lambda r: (not r["fits"], round(r["step_s"], 4), r["offloaded"]))
    best = recommend(rows)
    return {"model": config.model, "model_config": _shape(m), "parameters": parameter_count(m),
            "batch_size": s.batch(n), "seq_len": config.seq_len, "precision": config.precision,
            "stage": config.stage, "optimizer_name": config.optimizer_name, "machine": _machine(machine),
            "nodes_available": limit, "nodes": n, "state": s.state_table(n), "working": s.working(n),
            "classes": s.classes(candidates, least, limit), "placements": rows,
            "recommended": {"tiers": best["tiers"], "step_s": best["step_s"], "peak_fraction": best["peak_fraction"]},
            "notes": s.notes(n)}


def _model(config: Config):
    m = resolve_model(config.model)
    if config.seq_len > m.max_seq_len:
        raise ConfigError(f"seq_len={config.seq_len} exceeds the model's context of {m.max_seq_len}")
    return m


def _key(tiers: dict[str, str]) -> tuple:
    return tuple(tiers[k] for k in TIER_KEYS)


def _shape(m) -> dict:
    return {"arch": m.arch, "n_layers": m.n_layers, "d_model": m.d_model, "d_ff": m.d_ff, "n_heads": m.n_heads,
            "kv_heads": m.kv_heads, "vocab_size": m.vocab_size, "vocab_chunks": m.chunks}


def _machine(machine: Machine) -> dict:
    return {k: getattr(machine, k) for k in machine.__dataclass_fields__}


def _placement(tiers: dict[str, str]) -> str:
    return " ".join(f"{k}={tiers[k]}" for k in TIER_KEYS)


class _Setting:
    """A config's model on a machine: what a placement needs at ``n`` nodes, and how fast its step runs."""

    def __init__(self, config: Config, m, machine: Machine):
        self.config, self.m, self.machine = config, m, machine
        self.state = state_bytes(m, config.precision, config.optimizer_name)
        self.kinds = (*STATE_OF_KIND, "acts")
        self.budget = int(WORKING_FRACTION * machine.device_memory)
        self._tiles: dict[int, tuple] = {}

    # ---- per node and per device --------------------------------------------------------------

    def batch(self, n: int) -> int:
        """The global batch at ``n`` nodes: ``batch_size``, or with ``micro_batch_size`` (DeepSpeed's
        train_micro_batch_size_per_gpu) that many sequences x grad_accum on every device of the nodes."""
        c = self.config
        if c.micro_batch_size is None:
            return c.batch_size
        return c.micro_batch_size * c.grad_accum * n * self.machine.devices

    def nbytes(self, kind: str, n: int) -> int:
        """Bytes of ``kind`` for the whole model (activation checkpoints: for the batch at ``n`` nodes)."""
        if kind == "acts":
            return activation_checkpoint_bytes(self.m, self.batch(n), self.config.seq_len, self.config.precision)
        return self.state[STATE_OF_KIND[kind]]

    def partitioned(self, kind: str) -> bool:
        """Whether ZeRO at the config's stage splits ``kind`` over the devices (activations: always, each
        device keeps its own samples')."""
        stage = self.config.stage
        return {"params": stage >= 3, "grads": stage >= 2, "master": stage >= 1, "opt": stage >= 1}.get(kind, True)

    def per_device(self, kind: str, n: int) -> float:
        nbytes = self.nbytes(kind, n)
        return nbytes / (n * self.machine.devices) if self.partitioned(kind) else nbytes

    def per_node(self, kind: str, n: int) -> float:
        """What one node's host memory or NVMe holds of ``kind``: its devices' shares (a whole copy when the
        stage replicates it, as each process keeps its own)."""
        nbytes = self.nbytes(kind, n)
        return nbytes / n if self.partitioned(kind) else nbytes * self.machine.devices

    def samples(self, n: int) -> int:
        """Sequences of one micro-batch on a device at ``n`` nodes (at least 1: a device with none idles)."""
        micro = self.batch(n) // self.config.grad_accum
        return max(1, -(-micro // (n * self.machine.devices)))

    def tiling(self, n: int) -> tuple[int | None, int]:
        """The tile count picked at ``n`` nodes (None: none fits the budget), and its working memory."""
        samples = self.samples(n)
        if samples not in self._tiles:
            c = self.config
            tiles = pick_tiles(self.m, samples, c.seq_len, c.precision, self.budget)
            nbytes = largest_unit(self.m, tiles or 1, samples, c.seq_len, c.precision)[1]
            self._tiles[samples] = (tiles, nbytes)
        return self._tiles[samples]

    def fit(self, tiers: dict[str, str], n: int) -> dict:
        """What ``tiers`` needs at ``n`` nodes of each device's memory (its state share and the working
        memory), of each node's host memory and NVMe; what is short of each."""
        need = {"device": float(self.tiling(n)[1]), "host": 0.0, "nvme": 0.0}
        for kind in self.kinds:
            tier = tiers[KIND_TIER[kind]]
            need[tier] += self.per_device(kind, n) if tier == "device" else self.per_node(kind, n)
        have = {"device": self.machine.device_memory, "host": self.machine.host_memory,
                "nvme": self.machine.nvme_capacity}
        short = {k: need[k] - have[k] for k in need if need[k] > have[k]}
        if self.tiling(n)[0] is None:
            short.setdefault("device", need["device"] - have["device"])
        return {"need": need, "have": have, "short": short, "fits": not short}

    def fewest_nodes(self, tiers: dict[str, str], limit: int | None) -> int | None:
        """The fewest nodes at which ``tiers`` fits, up to ``limit``; None if it fits at none.

        Fitting is monotone in the nodes (shares and micro-batches only shrink), so a doubling then a
        bisection finds it.
        """
        top = limit or MAX_NODES
        hi = 1
        while not self.fit(tiers, hi)["fits"]:
            if hi >= top:
                return None
            hi = min(2 * hi, top)
        lo = hi // 2 + 1 if hi > 1 else 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.fit(tiers, mid)["fits"]:
                hi = mid
            else:
                lo = mid + 1
        return hi

    # ---- the step -----------------------------------------------------------------------------

    def moved(self, tiers: dict[str, str], n: int) -> dict[str, float]:
        """Bytes read from and written to each tier per step, all nodes together: parameters read twice
        and written once, the rest once each (`NOMINAL_TRAFFIC`, the local plan's figures without probes)."""
        out = {f"{op}_{t}": 0.0 for t in ("device", "host", "nvme") for op in ("read", "write")}
        for kind in self.kinds:
            nbytes = self.nbytes(kind, n)
            tier = tiers[KIND_TIER[kind]]
            reads, writes = NOMINAL_TRAFFIC[kind]
            out[f"read_{tier}"] += reads * nbytes
            out[f"write_{tier}"] += writes * nbytes
        return out

    def step(self, tiers: dict[str, str], n: int) -> dict:
        """The predicted step at ``n`` nodes: the local plan's accelerator model (compute, host copies and
        NVMe I/O overlap; the disk reads and writes in turn), with the network as one more overlapped term.
        The fraction of peak is the whole step's FLOPs over every device's peak for the step's time."""
        mc, c = self.machine, self.config
        devices = n * mc.devices
        psi = parameter_count(self.m)
        flops = FLOPS_PER_PARAM_TOKEN * psi * self.batch(n) * c.seq_len
        # The busiest device's share: its micro-batches' tokens (a device without a sequence idles).
        tokens = self.samples(n) * c.grad_accum * c.seq_len
        compute = FLOPS_PER_PARAM_TOKEN * psi * tokens / (mc.peak_flops * mc.matmul_efficiency)
        rates = {"engine_s": compute, "reference_s": compute, "host_copy_GBps": devices * mc.device_host_GBps,
                 "disk_read_GBps": n * mc.nvme_read_GBps or 1.0, "disk_write_GBps": n * mc.nvme_write_GBps or 1.0}
        moved = self.moved(tiers, n)
        out = predict(c, tiers, moved, rates, platform="accelerator")
        gathers = 3 if c.stage == 3 else 2  # ZeRO-3: params gathered twice, gradients reduce-scattered once
        out["network_s"] = gathers * self.state["params"] * (n - 1) / n / (mc.node_to_node_GBps * 1e9)
        out["step_s"] = max(out["step_s"], out["network_s"])
        out["peak_fraction"] = flops / out["step_s"] / (devices * mc.peak_flops)
        out["bytes_per_step"] = moved
        return out

    def row(self, tiers: dict[str, str], n: int) -> dict:
        f = self.fit(tiers, n)
        offloaded = sum({"device": 0, "host": 1, "nvme": 2}[t] for t in tiers.values())
        return {"tiers": tiers, "fits": f["fits"], "need": f["need"], "short": f["short"], "offloaded": offloaded,
                **self.step(tiers, n)}

    # ---- the report's parts -------------------------------------------------------------------

    def state_table(self, n: int) -> dict:
        return {kind: {"whole": self.nbytes(kind, n), "per_node": self.per_node(kind, n),
                       "per_device": self.per_device(kind, n), "partitioned": self.partitioned(kind)}
                for kind in self.kinds}

    def working(self, n: int) -> dict:
        c, m = self.config, self.m
        samples = self.samples(n)
        untiled, untiled_bytes = largest_unit(m, 1, samples, c.seq_len, c.precision)
        tiles, _ = self.tiling(n)
        unit, nbytes = largest_unit(m, tiles or 1, samples, c.seq_len, c.precision)
        name, rows, cols = largest_matrix(m)
        return {"paper": paper_working_memory(m, c.precision), "paper_matrix": [name, rows, cols],
                "samples_per_device": samples, "untiled": {"unit": untiled.name, "params": untiled.params,
                                                           "bytes": untiled_bytes},
                "tiles": tiles, "tiled": {"unit": unit.name, "params": unit.params, "bytes": nbytes},
                "budget": self.budget, "fraction": WORKING_FRACTION}

    def classes(self, candidates: list, least: dict, limit: int | None) -> list[dict]:
        """Per placement class, the fewest nodes that hold the state, the placement, and its step there."""
        out = []
        for name, member in CLASSES:
            inside = [t for t in candidates if member(t) and least[_key(t)] is not None]
            if not inside:
                out.append({"class": name, "nodes": None, "tiers": None, "step_s": None, "peak_fraction": None})
                continue
            steps = {_key(t): self.step(t, least[_key(t)]) for t in inside}
            best = min(inside, key=lambda t: (least[_key(t)], steps[_key(t)]["step_s"]))
            s = steps[_key(best)]
            out.append({"class": name, "nodes": least[_key(best)], "tiers": best, "step_s": s["step_s"],
                        "peak_fraction": s["peak_fraction"]})
        return out

    def shortfall(self, candidates: list, least: dict, limit: int | None) -> str:
        """One line: the model fits nowhere within ``limit`` nodes; the placement that needs the fewest
        nodes, what it lacks at the limit and by how much, and how many nodes it would take."""
        mc = self.machine
        if self.tiling(MAX_NODES)[0] is None:
            unit, nbytes = largest_unit(self.m, tile_counts(self.m)[-1], 1, self.config.seq_len,
                                        self.config.precision)
            return (f"{self.config.model} fits no device of {mc.name}: even one sequence at the most tiles, its "
                    f"{unit.name} needs {format_bytes(nbytes)} of working memory, more than {WORKING_FRACTION:g} "
                    f"of a device's {format_bytes(mc.device_memory)}")
        top = limit or 1
        unlimited = {_key(t): self.fewest_nodes(t, None) for t in candidates}

        def order(t):
            n = unlimited[_key(t)]
            return (n is None, n or 0)

        closest = min(candidates, key=order)
        f = self.fit(closest, top)
        names = {"device": "device memory", "host": "host memory per node", "nvme": "NVMe per node"}
        what = "; ".join(f"{names[k]} is short by {format_bytes(v)} (needs {format_bytes(f['need'][k])}, has "
                         f"{format_bytes(f['have'][k])})" for k, v in f["short"].items())
        needs = unlimited[_key(closest)]
        if limit is None:
            whole = ", ".join(k for k in self.kinds if not self.partitioned(k))
            return (f"{self.config.model} fits no placement on any number of nodes of {mc.name}: stage "
                    f"{self.config.stage} keeps all of {whole} on every device; on 1 node the closest "
                    f"({_placement(closest)}): {what}")
        more = f"; it fits on {needs} nodes" if needs else ""
        return (f"{self.config.model} fits no placement on {top} node(s) of {mc.name}; the closest "
                f"({_placement(closest)}): {what}{more}")

    def notes(self, n: int) -> list[str]:
        c, mc = self.config, self.machine
        notes = [f"compute counts {FLOPS_PER_PARAM_TOKEN} FLOPs per parameter per token (forward, the forward "
                 "rerun for activation checkpointing, backward); the fraction of peak counts them all",
                 "the optimizer's own time on the host (CPU Adam) is not modeled; the NVMe and host links are"]
        if not optimizer_slots(c.optimizer_name)[1]:
            notes.append(f"{c.optimizer_name}'s state has no simple count: counted as Adam's two fp32 moments")
        if mc.peak_flops_dtype and mc.peak_flops_dtype != c.precision:
            notes.append(f"the file's peak_flops is for {mc.peak_flops_dtype}, the config computes in {c.precision}")
        if c.mesh_axes().get("model", 1) != 1:
            notes.append(f"mesh {c.mesh}: the plan takes every device as data-parallel; the model axis is not "
                         "modeled")
        if c.micro_batch_size is not None:
            unused = f" (batch_size={c.batch_size} is not used)" if c.batch_size else ""
            notes.append(f"micro_batch_size={c.micro_batch_size}: the batch is {c.micro_batch_size} x grad_accum "
                         f"{c.grad_accum} x every device of the nodes used{unused}")
        elif c.batch_size // c.grad_accum < self.machine.devices * n:
            notes.append(f"a micro-batch of {c.batch_size // c.grad_accum} sequences leaves devices idle on "
                         f"{n} node(s): a device computes one sequence or none")
        return notes
