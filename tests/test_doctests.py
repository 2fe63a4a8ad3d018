"""The examples in the docstrings of the pure modules run, and print what they say.

Only modules whose examples are self-contained are listed; others show a call in context (a store,
a checkpoint on disk) and are read, not run.
"""

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = ["zinfjax._util.byte_sizes", "zinfjax._util.choices", "zinfjax._util.mapping_files", "zinfjax.program.jaxpr",
           "zinfjax.models.configs", "zinfjax.engine.budget", "zinfjax.engine.parts",
           "zinfjax.store.pool", "zinfjax.store.layout", "zinfjax.store.threads", "zinfjax.program.memo",
           "zinfjax.planning.recommend", "zinfjax.planning.machine", "zinfjax.planning.scale",
           "zinfjax.planning.machine_plan", "zinfjax.models.products", "tests.support.tolerances",
           "zinfjax.models.tiled", "zinfjax.models.tiled_nnx", "zinfjax.models.tiling", "zinfjax.planning.cost",
           "zinfjax.planning.calibrate", "zinfjax.planning.probes", "zinfjax.engine.engine_plan",
           "zinfjax.store.recycle", "zinfjax.store.chunkfile", "tests.support.xla_flags", "zinfjax.benchmarks.children",
           "zinfjax.sections"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # examples name files by their path in the repository (examples/demo.yaml)
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples to run"
    assert result.failed == 0
