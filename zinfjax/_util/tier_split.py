"""A part of the state placed by layer: one tier, or its layers split across the host and NVMe tiers.

A tier key (``params``, ``optimizer``, ``gradients``, ``activations``) names one tier (``nvme``), or a split:
terms ``TIER:COUNT`` in order, then the tier that takes the rest. ``host:12,nvme`` puts the first 12 slices of
every store of that part (a layer of a scan's blocks, a row chunk of the vocabulary) in host memory and the rest
on NVMe; a store of one slice (a group held whole) takes the first term's tier. A split takes the host and NVMe
tiers, each once; the device tier holds a part whole.

Example:
    >>> split = TierSplit.parse("host:12,nvme")
    >>> split.ranges(36)
    [('host', 0, 12), ('nvme', 12, 36)]
    >>> split.ranges(1), str(split), TierSplit.parse("nvme").ranges(4)
    ([('host', 0, 1)], 'host:12,nvme', [('nvme', 0, 4)])
"""

from __future__ import annotations

import dataclasses

TIERS = ("device", "host", "nvme")
SPLIT_TIERS = ("host", "nvme")


class SplitError(ValueError):
    """A tier key's value is neither a tier nor a split of host and nvme layers."""


@dataclasses.dataclass(frozen=True)
class TierSplit:
    """A tier key's placement: ``terms`` ``((tier, count), ..., (tier, None))``; one term is a whole tier."""

    terms: tuple[tuple[str, int | None], ...]

    @classmethod
    def parse(cls, text: str) -> TierSplit:
        """Parses ``TIER`` or ``TIER:COUNT,...,TIER``; raises `SplitError` with what is wrong and an example."""
        text = str(text).strip()
        if text in TIERS:
            return cls(((text, None),))
        hint = "use one of device, host, nvme, or a split such as host:12,nvme (12 layers on host, the rest on nvme)"
        words = [w.strip() for w in text.split(",")]
        if len(words) < 2:
            raise SplitError(f"{text!r} is not a tier or a split; {hint}")
        terms: list[tuple[str, int | None]] = []
        for word in words[:-1]:
            tier, _, count = word.partition(":")
            if tier not in SPLIT_TIERS or not count.isdigit() or int(count) < 1:
                raise SplitError(f"{word!r} in {text!r} is not TIER:COUNT with a tier host or nvme and a count of "
                                 f"1 or more; {hint}")
            terms.append((tier, int(count)))
        if words[-1] not in SPLIT_TIERS:
            raise SplitError(f"the last term of {text!r} must be host or nvme alone (it takes the rest); {hint}")
        terms.append((words[-1], None))
        tiers = [t for t, _ in terms]
        if len(set(tiers)) < len(tiers):
            raise SplitError(f"{text!r} names a tier twice; each tier takes one run of layers: {hint}")
        return cls(tuple(terms))

    @property
    def whole(self) -> bool:
        """Whether the part lives wholly on one tier."""
        return len(self.terms) == 1

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers named, in order."""
        return tuple(t for t, _ in self.terms)

    @property
    def counted(self) -> int:
        """The layers the counted terms name."""
        return sum(n for _, n in self.terms if n)

    def ranges(self, length: int) -> list[tuple[str, int, int]]:
        """``(tier, start, stop)`` of the slices ``0..length`` each tier holds, the empty ones left out."""
        out, start = [], 0
        for tier, count in self.terms:
            stop = length if count is None else min(length, start + count)
            if stop > start:
                out.append((tier, start, stop))
            start = stop
        return out

    def tier_at(self, i: int, length: int) -> str:
        """The tier of slice ``i`` of ``length``."""
        return next(t for t, a, b in self.ranges(length) if a <= i < b)

    def __str__(self) -> str:
        return ",".join(t if n is None else f"{t}:{n}" for t, n in self.terms)


def tiers_in(value: str) -> tuple[str, ...]:
    """The tiers a tier key's value names: ``("nvme",)``, ``("host", "nvme")``.

    Example:
        >>> tiers_in("host:3,nvme")
        ('host', 'nvme')
    """
    return TierSplit.parse(value).tiers
