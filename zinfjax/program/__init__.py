"""A user's functions as programs zinfjax streams: the loss cut at its scans, the initialiser and the
optimizer run one layer at a time (docs/design.md, "Programs").

Example:
    >>> from zinfjax.program import program_for
    >>> program = program_for(loss_fn, params_like, batch_like)
"""

from zinfjax.program.init import InitError, InitSource
from zinfjax.program.optimizer import UpdatePlan
from zinfjax.program.slicing import NotStreamableError
from zinfjax.program.split import Program, ProgramError, program_for, split

__all__ = ["InitError", "InitSource", "NotStreamableError", "Program", "ProgramError", "UpdatePlan", "program_for",
           "split"]
