"""Dynamic fp16 loss scaling: the rules that raise and lower the scale a step multiplies its loss by."""

from __future__ import annotations


class LossScale:
    """Dynamic fp16 loss scaling with DeepSpeed's defaults: skip and halve on overflow, double after 1000."""

    def __init__(self, enabled: bool, initial: float = 2.0**16, window: int = 1000, minimum: float = 1.0):
        self.enabled, self.scale, self.window, self.minimum, self.good = enabled, initial, window, minimum, 0

    @property
    def value(self) -> float:
        return self.scale if self.enabled else 1.0

    def after_step(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale, self.good = max(self.scale / 2, self.minimum), 0
            return
        self.good += 1
        if self.good >= self.window:
            self.scale, self.good = self.scale * 2, 0
