"""Stopping a run whose loss has become NaN or inf, instead of training on garbage to the end.

A step's loss is computed from the parameters of the step before, so a finite loss at step ``n``
vouches for the checkpoint of step ``n - 1``, and a non-finite one casts doubt on it. `LossWatch`
counts consecutive non-finite losses; at ``max_nonfinite_steps`` of them the run stops with
`NonFiniteLossError`.
fp16 overflow steps are another matter: there the loss is finite and the gradients overflow; the
engine's loss scaler skips them (as DeepSpeed does) and they are not counted here.

Example:
    >>> watch = LossWatch(max_steps=3, lr=1e9)
    >>> watch.after_step(1, 5.3)
    True
    >>> watch.after_step(2, float("nan")), watch.exhausted
    (False, False)
    >>> watch.after_step(3, float("inf")), watch.after_step(4, float("nan")), watch.exhausted
    (False, False, True)
    >>> raise watch.error(4, good=1)          # when the run stops, exhausted or at its last step
    Traceback (most recent call last):
    zinfjax.training.nonfinite.NonFiniteLossError: ...
"""

from __future__ import annotations

import math

from zinfjax.errors import UserError


class NonFiniteLossError(UserError):
    """The loss was NaN or inf for ``max_nonfinite_steps`` steps in a row, or at the last step."""


class LossWatch:
    """Counts the non-finite losses in a row; see the module docstring."""

    def __init__(self, max_steps: int, lr: float):
        self.max_steps, self.lr = max_steps, lr
        self.first: int | None = None  # the first step of the current run of non-finite losses
        self.last, self.last_value = 0, 0.0

    def after_step(self, step: int, loss: float) -> bool:
        """Whether ``loss``, the loss of ``step``, is finite."""
        if math.isfinite(loss):
            self.first = None
            return True
        self.first = step if self.first is None else self.first
        self.last_value, self.last = loss, step
        return False

    @property
    def failing(self) -> bool:
        """Whether the latest loss was not finite."""
        return self.first is not None

    @property
    def exhausted(self) -> bool:
        """Whether the latest ``max_steps`` losses were all not finite: the run must stop."""
        return self.first is not None and self.last - self.first + 1 >= self.max_steps

    def error(self, step: int, good: int | None = None, doubtful: list[int] | None = None) -> NonFiniteLossError:
        """The error for a run stopped at ``step``; ``good`` is the newest checkpoint a finite loss vouched for."""
        steps = f"step {step}" if self.first == step else f"steps {self.first}-{step}"
        message = (f"the loss was {self.last_value} at {steps}, so training stopped at step {step} "
                   f"(max_nonfinite_steps={self.max_steps}); lower lr (now {self.lr:g}) or set grad_clip")
        if good is not None:
            message += (f"; the newest checkpoint with finite parameters is step {good}: continue from it with "
                        f"resume={good} allow_config_change=true and a lower lr")
        if doubtful:
            message += (f"; step{'s' if len(doubtful) > 1 else ''} {', '.join(map(str, doubtful))} came after the "
                        "last finite loss and may hold non-finite parameters")
        return NonFiniteLossError(message)
