"""A Flax user's loop, as README.md's "In a Flax training loop" and docs/models.md's opening write it: each snippet
is read from the doc's own text and run, so that the docs cannot drift from what works.

What a snippet expects is given to it, as a user has it: the imports, a Linen model whose blocks are an
``nn.scan`` (the ViT of examples/vit_linen.py at a tiny size), its ``params``, and ``batches`` (images and labels,
batch axis first). Its ``nvme_path`` is pointed under the test's directory.
"""

import importlib.util
import pathlib
import re
import sys

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zinfjax

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 4
# doc -> (the heading its snippet is the first python block under, the nvme_path the snippet names)
SNIPPETS = {"README.md": ("## In a Flax training loop", '"/mnt/nvme/run1"'),
            "docs/models.md": ("# Your own model", '"/mnt/nvme/run"')}


def snippet(doc: str, heading: str) -> str:
    """The first fenced python block under ``heading`` (up to the next heading of its level) in ``doc``."""
    text = (ROOT / doc).read_text()
    level = heading.split(" ")[0]
    section = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^{level} |\Z)", text, flags=re.M | re.S)
    assert section, f"{doc} has no heading {heading!r}"
    blocks = re.findall(r"^```python\n(.*?)^```", section[1], flags=re.M | re.S)
    assert blocks, f"{doc}'s {heading!r} has no python block"
    return blocks[0]


def vit(monkeypatch):
    """examples/vit_linen.py, imported from its file (a module while the test runs: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("vit_linen", ROOT / "examples" / "vit_linen.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def recorded(batch, namespace: dict, losses: list):
    """``batch`` ``STEPS`` times; after each step, the loss of the ``metrics`` the snippet's loop left."""
    for _ in range(STEPS):
        yield batch
        losses.append(float(namespace["metrics"]["loss"]))


@pytest.mark.parametrize("doc", list(SNIPPETS))
def test_the_docs_wrap_snippet_trains_with_its_state_on_nvme(doc, tmp_path, monkeypatch):
    heading, nvme_path = SNIPPETS[doc]
    code = snippet(doc, heading)
    assert nvme_path in code, f"the snippet's nvme_path changed: update SNIPPETS[{doc!r}]"
    code = code.replace(nvme_path, repr(str(tmp_path / "nvme")))
    example = vit(monkeypatch)
    config = example.ViTConfig(image=16, patch=8, width=32, depth=2, heads=2, mlp=64)
    model, batch = example.ViT(config), example.batch_of(config, 8, seed=0)
    params = model.init(jax.random.key(0), batch["image"])["params"]
    losses: list[float] = []
    # what the user has: the imports README.md's snippet writes (docs/models.md's leaves them out), a model, params
    namespace = {"optax": optax, "zinfjax": zinfjax, "train_state": train_state, "model": model, "params": params}
    namespace["batches"] = recorded(batch, namespace, losses)
    exec(compile(code, f"{doc}, {heading}", "exec"), namespace)
    state, metrics = namespace["state"], namespace["metrics"]
    try:
        assert state.step == STEPS and len(losses) == STEPS and losses[-1] < losses[0], losses
        assert metrics["read_bytes_nvme"] > 0 and metrics["write_bytes_nvme"] > 0
        trained = state.read_params()
        assert not np.allclose(trained["head"]["kernel"], params["head"]["kernel"])
    finally:
        state.close()
    assert {p.name for p in (tmp_path / "nvme").iterdir()}, "nothing was stored under the snippet's nvme_path"
