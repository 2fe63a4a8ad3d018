"""Parameters for inference: stores of the compute copy on a tier, filled from a checkpoint or a tree.

Inference streams only the parameters (no master weights, no optimizer state), so it opens one
store per group (embed, blocks, head) on ``config.params`` and fills it one layer at a time:
from a zinfjax checkpoint (a training run's, or one written by ``zinfjax convert``), read through
tensorstore with every chunk's crc32c checked, or from an in-memory parameter tree.
"""

from __future__ import annotations

import functools
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from zinfjax._util.choices import COMPUTE_DTYPES, GROUPS
from zinfjax.checkpoint import format as fmt
from zinfjax.checkpoint.base import check_base
from zinfjax.checkpoint.errors import CheckpointError
from zinfjax.checkpoint.manager import latest_checkpoint
from zinfjax.config import Config
from zinfjax.engine.budget import with_defaults
from zinfjax.engine.stores import SCRATCH_NVME
from zinfjax.sections import Memory
from zinfjax.store import open_store
from zinfjax.store.pool import staging_pool


class ParamStores:
    """The parameter stores of one model on one tier, as ``stores[group]``; ``memory``: the read-ahead and staging
    buffers they stream with (``config``'s, fixed defaults where it leaves them to a budget: `with_defaults`).

    Example:
        >>> import tempfile
        >>> from zinfjax.checkpoint.writer import write_params
        >>> from zinfjax.inference.generate import abstract_params
        >>> from zinfjax.models import ModelConfig, build
        >>> model = ModelConfig.named("gpt2-tiny")
        >>> params = jax.jit(build(model).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        >>> ckpt = write_params(tempfile.mkdtemp(), params, model=model)
        >>> config = Config(params="nvme", nvme_path=tempfile.mkdtemp())
        >>> ps = ParamStores.from_checkpoint(ckpt, abstract_params(model), config)
        >>> layer = ps.stores["blocks"].read(3).result()
        >>> bool((layer["fc"]["kernel"] == params["blocks"]["fc"]["kernel"][3]).all())
        True
        >>> ps.close()
    """

    def __init__(self, abstract, config: Config, name: str = "infer"):
        self.config, self.memory = config, with_defaults(config.section(Memory))
        self.dtype = COMPUTE_DTYPES[config.precision]
        self.pool = staging_pool(self.memory.host_buffer_bytes)
        self.stores = {}
        for g in GROUPS:
            like = jax.tree.map(functools.partial(self._stacked, stacked=g == "blocks"), abstract[g])
            self.stores[g] = open_store(config.params, like, path=config.nvme_path, name=f"{name}_{g}",
                                        pool=self.pool, **SCRATCH_NVME)  # the memory tiers take no options

    def _stacked(self, x, stacked: bool) -> jax.ShapeDtypeStruct:
        dtype = self.dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        return jax.ShapeDtypeStruct(x.shape if stacked else (1, *x.shape), dtype)

    @classmethod
    def from_tree(cls, params, config: Config) -> ParamStores:
        ps = cls(params, config)
        for g in GROUPS:
            for i in range(ps.num_layers(g)):
                ps.write(g, i, jax.tree.map(operator.itemgetter(i), params[g]) if g == "blocks" else params[g])
        ps.flush()
        return ps

    @classmethod
    def from_checkpoint(cls, path: str, abstract, config: Config) -> ParamStores:
        directory = latest_checkpoint(path)
        meta = fmt.read_meta(directory)
        # A fine-tune's checkpoint holds its adapters; the frozen base it names (digest checked) the rest.
        dirs = [directory] + ([check_base(meta["base"], directory)] if meta.get("base") else [])
        ps = cls(abstract, config)
        for g in GROUPS:
            paths = jax.tree_util.tree_flatten_with_path(abstract[g])[0]
            treedef = jax.tree_util.tree_structure(abstract[g])
            arrays = []
            for keypath, _ in paths:
                name = ".".join(str(k) for k in fmt.key_path(g, keypath))
                leaf_dir = next((d for d in (os.path.join(x, "params", name) for x in dirs) if os.path.isdir(d)), None)
                if leaf_dir is None:
                    raise CheckpointError(f"{directory} has no parameter {name}: it was saved from another model")
                arrays.append(ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": leaf_dir}},
                                      open=True).result())
            for i in range(ps.num_layers(g)):
                leaves = [(a[i] if g == "blocks" else a).read().result() for a in arrays]
                ps.write(g, i, jax.tree_util.tree_unflatten(treedef, leaves))
        ps.flush()
        return ps

    def num_layers(self, group: str) -> int:
        return self.stores[group].num_layers

    def write(self, group: str, i: int, tree) -> None:
        def cast(x):
            x = np.asarray(x)
            return x.astype(self.dtype) if np.issubdtype(x.dtype, np.floating) else x

        self.stores[group].write(i if group == "blocks" else 0, jax.tree.map(cast, tree)).result()

    def flush(self) -> None:
        for s in self.stores.values():
            s.flush()

    def close(self) -> None:
        for s in self.stores.values():
            s.close()
