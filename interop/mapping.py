"""A user's name mapping: a torch ``state_dict``'s tensor names to zinfjax leaves, as a table.

A mapping file (JSON or YAML) maps each torch tensor name (``{i}`` stands for the layer index)
to a zinfjax leaf path, or to ``null`` for a tensor zinfjax does not keep (a buffer, a tied copy).
A value may also be a mapping that gives the layout (`zinfjax_interop.tables.Layout`):

```yaml
transformer.wte.weight: embed/wte/embedding                          # layout: same
transformer.h.{i}.attn.c_attn.weight:                                # fused q, k, v along the output axis
  to: [blocks/q/kernel, blocks/k/kernel, blocks/v/kernel]
  layout: conv1d                                                     # same, flat, linear, conv1d
transformer.h.{i}.attn.c_proj.weight: {to: blocks/attn_out/kernel, layout: conv1d, in_axes: 2}
lm_head.weight: null                                                 # tied to wte: skipped
```

`load_mapping` checks the file against the model (every leaf mapped once, every path a leaf,
``{i}`` exactly on the block leaves) and returns an `ArchTable`, which `HFCheckpoint.from_files`
follows as it follows the Hugging Face tables.

Example (a nanoGPT state_dict: Hugging Face's names, its projections nn.Linear):
    >>> import numpy as np, tempfile, torch
    >>> from zinfjax_interop.files import StateDictFile, TensorFiles
    >>> from zinfjax_interop.hf import HFCheckpoint, save_hf
    >>> model, rng = ModelConfig.named("gpt2-tiny"), np.random.default_rng(0)
    >>> gpt2_dir = tempfile.mkdtemp()
    >>> params = {p: rng.normal(0, 0.02, s).astype(np.float32) for p, s in zinfjax_shapes(model).items()}
    >>> save_hf(params, model, gpt2_dir)
    >>> linear = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    >>> with TensorFiles.open(gpt2_dir) as hf:              # Conv1D's (in, out) as nn.Linear's (out, in)
    ...     state = {n: torch.from_numpy(hf.get(n).T.copy() if n.endswith(linear) else hf.get(n))
    ...              for n in hf.names() if n != "lm_head.weight"}
    >>> torch.save(state, f"{gpt2_dir}/model.pt")
    >>> table = load_mapping("examples/mapping_nanogpt.yaml", model)
    >>> ckpt = HFCheckpoint.from_files("model.pt", model, table, StateDictFile(f"{gpt2_dir}/model.pt"))
    >>> ckpt.read("blocks/fc/kernel", 2).shape
    (64, 256)
    >>> ckpt.close()
"""

from __future__ import annotations

import os

from zinfjax._util.mapping_files import read_mapping
from zinfjax.models import ModelConfig
from zinfjax_interop.errors import ConversionError
from zinfjax_interop.hf import zinfjax_shapes
from zinfjax_interop.tables import ArchTable, Layout, Rule

KEYS = ("to", "layout", "in_axes")


class MappingError(ConversionError):
    """A mapping file that cannot be followed: it names the key at fault."""


def load_mapping(path: str, model: ModelConfig) -> ArchTable:
    """Reads the mapping file ``path`` as a table of `Rule`s for ``model``, checked whole.

    Example:
        >>> load_mapping("examples/mapping_nanogpt.yaml", ModelConfig.named("gpt2-tiny")).rules[0].hf
        'transformer.wte.weight'
    """
    raw = _read(path)
    rules = tuple(_rule(path, name, value) for name, value in raw.items())
    _check_cover(path, rules, model)
    return ArchTable(model_type=f"mapped by {os.path.basename(path)}", arch=model.arch, export_as="",
                     bodies=("",), rules=rules)


def _read(path: str) -> dict:
    raw = read_mapping(path, "mapping file", MappingError)
    if not raw:
        raise MappingError(f"mapping file {path} must map torch tensor names to zinfjax leaf paths")
    return raw


def _rule(path: str, name, value) -> Rule:
    where = f"mapping file {path}, key {name!r}"
    if not isinstance(name, str):
        raise MappingError(f"{where}: a key must be a torch tensor name")
    try:
        name.format(i=0)
    except (KeyError, IndexError, ValueError) as e:
        raise MappingError(f"{where}: a name may hold only {{i}} (the layer index) in braces ({e!r})") from e
    if value is None:
        return Rule(name, (), top=True)
    if isinstance(value, str | list):
        value = {"to": value}
    if not isinstance(value, dict):
        raise MappingError(f"{where}: the value must be a zinfjax leaf path, null, or a mapping with {', '.join(KEYS)}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise MappingError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}; known: {', '.join(KEYS)}")
    to = value.get("to")
    paths = [to] if isinstance(to, str) else to
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise MappingError(f"{where}: 'to' must be a zinfjax leaf path or a list of them")
    layouts = [m.value for m in Layout]
    layout = value.get("layout", "same")
    if layout not in layouts:
        raise MappingError(f"{where}: layout {layout!r} is not one of {', '.join(layouts)}")
    in_axes = value.get("in_axes", 1)
    if not isinstance(in_axes, int) or isinstance(in_axes, bool) or in_axes < 1:
        raise MappingError(f"{where}: in_axes must be a positive integer")
    zinfjax = paths[0] if len(paths) == 1 else tuple(paths)
    return Rule(name, zinfjax, Layout(layout), in_axes=in_axes, top=True)


def _check_cover(path: str, rules: tuple[Rule, ...], model: ModelConfig) -> None:
    """Every leaf of the model mapped once; block leaves by names with ``{i}``, the others by names without."""
    leaves = zinfjax_shapes(model)
    seen: dict[str, str] = {}
    for rule in rules:
        for p in rule.paths:
            where = f"mapping file {path}, key {rule.hf!r}"
            if p not in leaves:
                raise MappingError(f"{where}: {p} is not a leaf of the {model.arch} model; its leaves are "
                                   f"{', '.join(leaves)}")
            if p in seen:
                raise MappingError(f"{where}: {p} is mapped twice (also by {seen[p]!r})")
            if p.startswith("blocks/") != rule.per_layer:
                need = "needs {i} in the torch name" if p.startswith("blocks/") else "is not per layer: drop {i}"
                raise MappingError(f"{where}: {p} {need}")
            seen[p] = rule.hf
    unmapped = [p for p in leaves if p not in seen]
    if unmapped:
        raise MappingError(f"mapping file {path} maps no torch tensor to {len(unmapped)} leaf(s) of the "
                           f"{model.arch} model: {', '.join(unmapped)}")
