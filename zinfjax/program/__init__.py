"""A user's functions as programs zinfjax streams: the loss cut at its scans, the initialiser and the
optimizer run one layer at a time (docs/design.md, "Programs").

Example:
    >>> import jax, jax.numpy as jnp
    >>> from zinfjax.program import program_for
    >>> def loss_fn(params, batch):               # an embedding, then 3 layers: a scan over their stacked weights
    ...     layer = lambda h, w: (jnp.tanh(h @ w), None)
    ...     return jnp.mean(jax.lax.scan(layer, batch @ params["embed"], params["blocks"])[0] ** 2)
    >>> params_like = {"embed": jax.ShapeDtypeStruct((4, 8), jnp.float32),
    ...                "blocks": jax.ShapeDtypeStruct((3, 8, 8), jnp.float32)}
    >>> program = program_for(loss_fn, params_like, jax.ShapeDtypeStruct((2, 4), jnp.float32))
    >>> [s.kind for s in program.stages], [(g.name, g.length) for g in program.streamed_groups()]
    (['whole', 'scan', 'whole'], [('s:blocks', 3)])
"""

from zinfjax.program.init import InitError, InitSource
from zinfjax.program.optimizer import UpdatePlan
from zinfjax.program.slicing import NotStreamableError
from zinfjax.program.split import Program, ProgramError, program_for, split

__all__ = ["InitError", "InitSource", "NotStreamableError", "Program", "ProgramError", "UpdatePlan", "program_for",
           "split"]
