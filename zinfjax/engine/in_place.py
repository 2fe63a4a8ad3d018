"""A frozen base opened in place: the leaves a fine-tune never writes, read from the checkpoint that holds them.

A run that starts from (or resumes onto) a base checkpoint reads its frozen leaves every step and
never writes them (`zinfjax.program.frozen`). Where such a leaf's checkpoint chunks are exactly the
chunks the nvme params store would write (one whole layer each, in the compute dtype, unsharded), the
store reads them where they are (`zinfjax.store.nvme.NvmeStore`'s ``in_place``) instead of copying the base
into ``nvme_path``: a fp32 fine-tune of a converted model (`zinfjax convert` writes one layer a chunk)
at ZeRO stages 0-2. A bf16 run of a fp32 base, or stage 3's device shards, copies it (cast, or cut),
and the step log says which (``base.in_place_bytes`` and ``base.copied_bytes``).

Example (adapters ``a`` trained beside a base's weights ``w``, frozen in the base's checkpoint):
    >>> import jax, jax.numpy as jnp, optax, tempfile
    >>> from zinfjax import Config
    >>> from zinfjax.checkpoint import CheckpointSource
    >>> from zinfjax.checkpoint.writer import write_params
    >>> from zinfjax.engine import Engine, TreeSource, update_plan
    >>> from zinfjax.program import program_for
    >>> from zinfjax.sharding import make_mesh
    >>> def loss_fn(params, batch):                   # three layers: a scan over their stacked weights
    ...     layer = lambda h, p: (jnp.tanh(h @ p["w"] + h @ p["a"]), None)
    ...     return jnp.mean(jax.lax.scan(layer, batch, params["blocks"])[0] ** 2)
    >>> params = {"blocks": {"w": np.ones((3, 8, 8), np.float32) / 8, "a": np.zeros((3, 8, 8), np.float32)}}
    >>> base = write_params(tempfile.mkdtemp(), {"blocks": {"w": params["blocks"]["w"]}})
    >>> tx = optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
    ...                            {"blocks": {"w": "frozen", "a": "train"}})
    >>> program = program_for(loss_fn, params, jnp.ones((8, 8)))
    >>> plan = update_plan(tx, program)
    >>> source = CheckpointSource(base, program, plan, start=True, fallback=TreeSource(program, plan, params))
    >>> config = Config(params="nvme", nvme_path=tempfile.mkdtemp())
    >>> engine = Engine(program, source, tx, config.engine_settings(), make_mesh({"data": 1}))   # calls in_place_leaves
    >>> engine.in_place == {"s:blocks": {"blocks/w": f"{base}/params/blocks.w"}}
    True
    >>> engine.close()
"""

from __future__ import annotations

import numpy as np


def in_place_leaves(params_tier: str, program, source, base_leaves: frozenset, placement,
                    compute_dtype) -> dict[str, dict]:
    """``{group: {leaf path: leaf directory}}``: the base leaves the params store reads in place (module docstring);
    none unless ``params_tier`` (the ``params`` key) is ``nvme``."""
    if params_tier != "nvme" or not base_leaves:
        return {}
    out: dict[str, dict] = {}
    for k in sorted(base_leaves):
        leaf = program.leaves[k]
        where = source.leaf_dir(leaf.path)
        if where is not None and _same_chunks(leaf, where[1], placement, compute_dtype):
            out.setdefault(leaf.group, {})[leaf.path] = where[0]
    return out


def _same_chunks(leaf, meta: dict, placement, compute_dtype) -> bool:
    """Whether the checkpoint leaf ``meta`` is chunked as the store holds ``leaf``: whole layers, same dtype."""
    stream = leaf.stream
    if stream is None or stream.rows or stream.tiles:
        return False
    sharding = placement.stacked("params", leaf.path, leaf.slice_shape)
    return (np.dtype(meta["dtype"]) == np.dtype(compute_dtype) and sharding.is_fully_replicated
            and list(meta["chunk_shape"]) == [1, *leaf.slice_shape] and list(meta["shape"]) == list(leaf.shape))


def nbytes(program, leaves) -> int:
    """The bytes of the leaves ``leaves`` (indices) of ``program``."""
    return sum(int(np.prod(program.leaves[k].shape)) * np.dtype(program.leaves[k].dtype).itemsize for k in leaves)
