"""A machine described in a file, for ``zinfjax plan --machine``: its nodes, devices, memories, disks and links.

Nothing is probed: every figure comes from the file (YAML or JSON, read strictly by
`zinfjax._util.mapping_files.read_mapping`), and each names its source in ``sources:`` or in a
comment beside it. The layout (examples/machines/ holds three)::

    name: DGX-2                     # optional: how the plan names the machine
    nodes: 32                       # optional: the nodes available; unset, as many as the model needs
    node:
      devices: 16                   # accelerators per node
      device:
        memory: 32GB                # bytes of each device's memory (a byte size: 32GB, 32GiB, 3.2e10)
        peak_flops: 125e12          # FLOP/s of one device in the compute dtype
        peak_flops_dtype: fp16      # optional: the dtype peak_flops is for (fp32, bf16, fp16)
      matmul_efficiency: 0.4        # the fraction of peak_flops a step's matrix products achieve
      host_memory: 1.5TB            # bytes of host memory per node
      nvme_capacity: 30.72TB        # bytes of NVMe per node (0: none)
      nvme_read_GBps: 24            # GB/s the node's NVMe reads, all drives together
      nvme_write_GBps: 12           # GB/s it writes
      device_host_GBps: 3           # GB/s between one device and host memory, every device at once
      node_to_node_GBps: 100        # GB/s into (and out of) one node from the others
    sources:
      node.device.memory: "NVIDIA DGX-2 datasheet: 16 x V100 32 GB"

Example:
    >>> m = machine_from_dict({"node": {"devices": 8, "device": {"memory": "16GB", "peak_flops": 197e12},
    ...     "matmul_efficiency": 0.5, "host_memory": "512GiB", "nvme_capacity": 0, "device_host_GBps": 15,
    ...     "node_to_node_GBps": 25}})
    >>> m.devices, m.device_memory, m.nvme_read_GBps
    (8, 16000000000, 0.0)
    >>> machine_from_dict({"node": {"devices": 8}})
    Traceback (most recent call last):
    ...
    zinfjax.errors.ConfigError: the machine: node.device.memory is missing: bytes of each device's memory, e.g. 32GB
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zinfjax._util.byte_sizes import parse_bytes
from zinfjax._util.choices import PRECISIONS
from zinfjax._util.mapping_files import read_mapping
from zinfjax.errors import ConfigError, printable

# Each figure: (its path in the file, its kind, what it is). Kinds: "count" a whole number 1 or more,
# "bytes" a byte size 0 or more ("size": above 0), "rate" a number above 0 ("rate0": 0 or more),
# "fraction" above 0 and at most 1.
FIGURES = (
    ("node.devices", "count", "accelerators per node, e.g. 16"),
    ("node.device.memory", "size", "bytes of each device's memory, e.g. 32GB"),
    ("node.device.peak_flops", "rate", "FLOP/s of one device in the compute dtype, e.g. 125e12"),
    ("node.matmul_efficiency", "fraction", "the fraction of peak_flops a step achieves, e.g. 0.4"),
    ("node.host_memory", "size", "bytes of host memory per node, e.g. 1.5TB"),
    ("node.nvme_capacity", "bytes", "bytes of NVMe per node, e.g. 30TB (0: none)"),
    ("node.nvme_read_GBps", "rate0", "GB/s the node's NVMe drives read together, e.g. 24"),
    ("node.nvme_write_GBps", "rate0", "GB/s the node's NVMe drives write together, e.g. 12"),
    ("node.device_host_GBps", "rate", "GB/s between one device and host memory, every device at once, e.g. 12"),
    ("node.node_to_node_GBps", "rate", "GB/s into one node from the others, e.g. 100"),
)
OPTIONAL = {"node.device.peak_flops_dtype", "nodes", "name", "sources"}
NVME_RATES = ("node.nvme_read_GBps", "node.nvme_write_GBps")  # needed only with nvme_capacity above 0


@dataclass(frozen=True)
class Machine:
    """One kind of node, and how many of them there are (None: as many as a model needs)."""

    devices: int
    device_memory: int
    peak_flops: float
    matmul_efficiency: float
    host_memory: int
    nvme_capacity: int
    nvme_read_GBps: float
    nvme_write_GBps: float
    device_host_GBps: float
    node_to_node_GBps: float
    nodes: int | None = None
    peak_flops_dtype: str | None = None
    name: str = "the machine"
    sources: dict[str, str] = field(default_factory=dict)


def load_machine(path: str) -> Machine:
    """The machine the file at ``path`` describes; a missing, negative or non-numeric figure is named."""
    return machine_from_dict(read_mapping(path, "machine file"), f"machine file {path}")


def machine_from_dict(values: dict, where: str = "the machine") -> Machine:
    """A `Machine` from the file's mapping; every error is one line that names the field and ``where``."""
    _check_keys(values, where)
    figures = {}
    for path, kind, doc in FIGURES:
        raw = _lookup(values, path)
        if raw is None and path in NVME_RATES:
            raw = 0
        if raw is None:
            raise ConfigError(f"{where}: {path} is missing: {doc}")
        figures[path.rsplit(".", 1)[-1]] = _figure(raw, path, kind, doc, where)
    if figures["nvme_capacity"] > 0:
        _check_nvme_rates(values, figures, where)
    return Machine(
        devices=int(figures["devices"]), device_memory=int(figures["memory"]), peak_flops=figures["peak_flops"],
        matmul_efficiency=figures["matmul_efficiency"], host_memory=int(figures["host_memory"]),
        nvme_capacity=int(figures["nvme_capacity"]), nvme_read_GBps=figures["nvme_read_GBps"],
        nvme_write_GBps=figures["nvme_write_GBps"], device_host_GBps=figures["device_host_GBps"],
        node_to_node_GBps=figures["node_to_node_GBps"], nodes=_nodes(values.get("nodes"), where),
        peak_flops_dtype=_dtype(_lookup(values, "node.device.peak_flops_dtype"), where),
        name=str(values.get("name") or "the machine"), sources=_sources(values.get("sources"), where))


def _check_nvme_rates(values: dict, figures: dict, where: str) -> None:
    """A machine with NVMe names both its rates, each above 0: a missing one is named missing, not 0."""
    docs = {path: doc for path, _, doc in FIGURES}
    for path in NVME_RATES:
        when = f"when node.nvme_capacity is above 0 (it is {figures['nvme_capacity']:.0f} bytes)"
        if _lookup(values, path) is None:
            raise ConfigError(f"{where}: {path} is missing: {docs[path]}; it is needed {when}")
        if figures[path.rsplit(".", 1)[-1]] <= 0:
            raise ConfigError(f"{where}: {path} must be above 0 {when}")


def _known() -> set[str]:
    return {p for p, _, _ in FIGURES} | OPTIONAL


def _check_keys(values: dict, where: str, prefix: str = "") -> None:
    """Every key of the file is one the layout has: a misspelt figure is named, not ignored."""
    known = _known()
    for key, value in values.items():
        path = f"{prefix}{key}"
        if path == "sources":
            continue
        if not isinstance(key, str) or (path not in known and not any(k.startswith(path + ".") for k in known)):
            names = ", ".join(sorted(known))
            raise ConfigError(f"{where}: unknown key {printable(path)}; the keys are {names}")
        if any(k.startswith(path + ".") for k in known):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {path} must be a mapping (of {', '.join(sorted(_children(path)))})")
            _check_keys(value, where, path + ".")


def _children(path: str) -> set[str]:
    return {k[len(path) + 1:].split(".")[0] for k in _known() if k.startswith(path + ".")}


def _lookup(values: dict, path: str):
    node = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _figure(raw, path: str, kind: str, doc: str, where: str) -> float:
    """One figure as a number, checked against its kind: the message names the field and the value."""
    if kind in ("bytes", "size"):
        try:
            value = float(parse_bytes(raw))
        except ConfigError as err:
            raise ConfigError(f"{where}: {path}={raw!r} is not a byte size: {doc}") from err
    else:
        value = _number(raw, path, doc, where)
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {path}={raw!r} must be finite: {doc}")
    if kind == "count" and (value < 1 or not value.is_integer()):
        raise ConfigError(f"{where}: {path}={raw!r} must be a whole number, 1 or more: {doc}")
    if kind in ("bytes", "rate0") and value < 0:
        raise ConfigError(f"{where}: {path}={raw!r} must be 0 or more: {doc}")
    if kind in ("rate", "size") and value <= 0:
        raise ConfigError(f"{where}: {path}={raw!r} must be above 0: {doc}")
    if kind == "fraction" and not 0 < value <= 1:
        raise ConfigError(f"{where}: {path}={raw!r} must be above 0 and at most 1: {doc}")
    return value


def _number(raw, path: str, doc: str, where: str) -> float:
    """A number as YAML gives it: an int, a float, or a string such as ``125e12`` (YAML 1.1 reads that as text)."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ConfigError(f"{where}: {path}={raw!r} is not a number: {doc}")
    try:
        return float(raw)
    except (ValueError, OverflowError) as err:
        raise ConfigError(f"{where}: {path}={raw!r} is not a number: {doc}") from err


def _nodes(raw, where: str) -> int | None:
    if raw is None:
        return None
    return int(_figure(raw, "nodes", "count", "the nodes available, e.g. 32 (leave it out for no limit)", where))


def _dtype(raw, where: str) -> str | None:
    if raw is not None and raw not in PRECISIONS:
        raise ConfigError(f"{where}: node.device.peak_flops_dtype={raw!r} is not one of {', '.join(PRECISIONS)}")
    return raw


def _sources(raw, where: str) -> dict[str, str]:
    """``sources:``: a figure's path to where it comes from. A path that names no figure is refused."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: sources must be a mapping of a figure's path (e.g. node.host_memory) to its "
                          "source")
    unknown = sorted(printable(k) for k in raw if k not in _known() - {"sources"})
    if unknown:
        raise ConfigError(f"{where}: sources names {', '.join(unknown)}, which is no figure of the file; the "
                          f"figures are {', '.join(sorted(_known() - {'sources'}))}")
    return {str(k): str(v) for k, v in raw.items()}
