"""``tiers=auto`` with an ``nvme_path``: memory first, the disk for the rest, layer by layer.

Every part of the state starts on NVMe. Then, part by part in the order that saves the most disk bytes per
byte of memory (a parameter byte is read twice and written once a step, an optimizer-state byte read and
written once: the calibrated traffic where the plan measured it), each part takes the most layers in host
memory that still fit the budget with room for the engine to read ahead (`zinfjax.planning.cost.fit`). A part
that fits whole goes to host memory whole; one that fits in part is split (``host:12,nvme``,
`zinfjax._util.tier_split`). The plan predicts the placement like any other and keeps it when it is the fastest.

Example (gpt2-small in a 2 GiB budget; `zinfjax.planning.make_plan` weighs what this fills among its placements):
    >>> import tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.planning import make_plan
    >>> config = Config(model="gpt2-small", nvme_path=tempfile.mkdtemp(), memory_limit="2GiB", batch_size=8)
    >>> plan = make_plan(config, probe=False, baseline=0)
    >>> [row["tiers"] for row in plan["placements"] if row["tiers"]["params"].startswith("host:")]
    [{'params': 'host:18,nvme', 'optimizer': 'nvme', 'gradients': 'nvme', 'activations': 'nvme'}]
"""

from __future__ import annotations

from zinfjax._util.choices import TIER_KEYS
from zinfjax.planning.cost import NOMINAL_TRAFFIC, fit
from zinfjax.planning.state import KIND_TIER, tree_bytes


def fill_memory(config, parts: dict, stores, machine: dict, cut: dict | None = None, factors: dict | None = None,
                regime: str = "heap") -> dict[str, str] | None:
    """The placement that fills host memory first (see the module docstring), leaving the engine the budget
    ``regime`` (`zinfjax.planning.cost.fit`: its least, roomy, or roomy with the heap's room); None when even every
    part on NVMe does not fit so."""
    keys = [k for k in TIER_KEYS if any(KIND_TIER[kind] == k for kind, _, _ in stores)]
    tiers = {k: "nvme" if k in keys else "device" for k in TIER_KEYS}
    if not fit(config, parts, stores, tiers, machine, cut, regime)["fits"]:
        return None

    def fits(key: str, count: int, length: int) -> bool:
        trial = {**tiers, key: layers_in_memory(count, length)}
        return fit(config, parts, stores, trial, machine, cut, regime)["fits"]

    for key in sorted(keys, key=lambda k: -saved_per_byte(k, stores, factors)):
        length = max(like_length(like) for kind, _, like in stores if KIND_TIER[kind] == key)
        lo, hi = 0, length  # the most layers that fit: fit is monotonic in them
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(key, mid, length) else (lo, mid - 1)
        tiers[key] = layers_in_memory(lo, length)
    return tiers


def layers_in_memory(count: int, length: int) -> str:
    """The tier key's value for ``count`` of ``length`` layers in host memory, the rest on NVMe.

    Example:
        >>> layers_in_memory(0, 36), layers_in_memory(12, 36), layers_in_memory(36, 36)
        ('nvme', 'host:12,nvme', 'host')
    """
    if count <= 0:
        return "nvme"
    return "host" if count >= length else f"host:{count},nvme"


def saved_per_byte(key: str, stores, factors: dict | None) -> float:
    """Disk bytes a step moves per byte of the part ``key`` held on NVMe: what a byte of memory saves."""
    factors = (factors or {}).get("nvme") or (factors or {}).get("device") or {}
    moved = held = 0.0
    for kind, group, like in stores:
        if KIND_TIER[kind] == key:
            n = tree_bytes(like)
            r, w = factors.get(f"{kind}|{group}") or NOMINAL_TRAFFIC[kind]
            moved, held = moved + (r + w) * n, held + n
    return moved / held if held else 0.0


def like_length(like) -> int:
    """The slices of a store's abstract tree (its leaves' leading axis)."""
    return next(iter(like.values())).shape[0] if like else 0
