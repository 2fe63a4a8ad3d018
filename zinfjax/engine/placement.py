"""Where the engine's values live on the mesh: per-leaf shardings of every kind of state, and of activations.

A leaf's sharding is a function of its kind (params, grads, opt, master), its key path (tensor
parallel rules match its end) and the shape of one slice (a layer, a row chunk, or the whole leaf):
the ZeRO stage decides which kinds are split over ``data`` (zinfjax/sharding.py).

Inside the stage functions a parameter is constrained to the *compute* layout (gathered over
``data``: ZeRO-3's just-in-time all-gather), a gradient to the stage's gradient layout (split over
``data`` from stage 2: a reduce-scatter), and an activation or residual, whose axes are
``(micro-batch, rows, ...)``, to rows split over ``data``.

Example (8 devices; on a CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):
    >>> import jax.numpy as jnp
    >>> from zinfjax.program import program_for
    >>> from zinfjax.sharding import make_mesh
    >>> def loss_fn(params, x):                   # four MLP blocks: fc (64 -> 256), proj (256 -> 64)
    ...     layer = lambda h, p: (h + jnp.tanh(h @ p["fc"]["kernel"]) @ p["proj"]["kernel"], None)
    ...     return jnp.mean(jax.lax.scan(layer, x, params["blocks"])[0] ** 2)
    >>> params = {"blocks": {"fc": {"kernel": jnp.zeros((4, 64, 256))}, "proj": {"kernel": jnp.zeros((4, 256, 64))}}}
    >>> program = program_for(loss_fn, params, jnp.ones((8, 64)))
    >>> mesh = make_mesh({"data": 8})
    >>> placement = Placement(program, ShardingRules.for_mesh(mesh, stage=3), mesh)
    >>> placement.sharding("params", "blocks/fc/kernel", (64, 256)).spec      # a layer's slice, at rest
    P(None, 'data')
    >>> placement.stacked("params", "blocks/fc/kernel", (64, 256)).spec      # its store leaf: layers stacked
    P(None, None, 'data')
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax.sharding import ShardingRules


class Placement:
    """Sharding constraints of a program's values (hashable by identity: one per engine layout)."""

    def __init__(self, program, rules: ShardingRules, mesh: Mesh):
        self.program, self.rules, self.mesh = program, rules, mesh
        self.trivial = mesh.devices.size == 1
        self._compute = rules.compute()

    def sharding(self, kind: str, path: str, shape, rules: ShardingRules | None = None) -> NamedSharding:
        """The sharding of one slice of shape ``shape`` of the ``kind`` leaf at ``path``."""
        return NamedSharding(self.mesh, (rules or self.rules).spec(kind, path, tuple(shape)))

    def stacked(self, kind: str, path: str, slice_shape) -> NamedSharding:
        """The sharding of a store leaf: slices stacked on an unsharded leading axis."""
        return NamedSharding(self.mesh, P(None, *self.rules.spec(kind, path, tuple(slice_shape))))

    def _constrain(self, x, kind: str, k: int, rules: ShardingRules):
        if self.trivial:
            return x
        leaf = self.program.leaves[k]
        return jax.lax.with_sharding_constraint(x, self.sharding(kind, leaf.path, x.shape, rules))

    def params(self, k: int, x):
        """Parameter ``k`` (a slice or the whole leaf) in the compute layout."""
        return self._constrain(x, "params", k, self._compute)

    def grads(self, k: int, g):
        """Gradient ``k`` in the stage's gradient layout."""
        return self._constrain(g, "grads", k, self.rules)

    def rows_sharding(self, shape, lead: int = 1) -> NamedSharding:
        """Activations ``(lead axes..., rows, ...)``: rows split over ``data`` when they divide, else whole."""
        data = self.mesh.shape["data"]
        spec = [None] * len(shape)
        if len(shape) > lead and data > 1 and shape[lead] % data == 0:
            spec[lead] = "data"
        return NamedSharding(self.mesh, P(*spec))

    def rows(self, x):
        """A residual or activation ``(A, rows, ...)`` with its rows split over ``data``."""
        if self.trivial or not hasattr(x, "shape"):
            return x
        return jax.lax.with_sharding_constraint(x, self.rows_sharding(x.shape))
