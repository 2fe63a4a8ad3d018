"""The words every layer shares, defined once: tiers, groups, compute precisions.

The store, engine, models, inference and config all name these; each imports them from here, so
no layer has to import another (see docs/design.md, the layering).

Example:
    >>> TIERS
    ('device', 'host', 'nvme')
    >>> COMPUTE_DTYPES["bf16"].__name__
    'bfloat16'
"""

import jax.numpy as jnp

TIERS = ("device", "host", "nvme")  # where a store keeps its slices
TIER_KEYS = ("params", "optimizer", "gradients", "activations")  # the Config keys that choose a tier
GROUPS = ("embed", "blocks", "head")  # the parameter groups of a layered model
COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}  # Config.precision -> dtype
PRECISIONS = tuple(COMPUTE_DTYPES)
