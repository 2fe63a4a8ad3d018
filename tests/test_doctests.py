"""Every example in a docstring runs, and prints what it says: every module of zinfjax, of zinfjax_interop (the
repository's interop/) and of tests/support whose source holds ``>>>``.

The modules are found by walking those trees, so an example added anywhere runs without a list to keep. An
example that needs a file, a store or a checkpoint makes its own, in a temporary directory (``tempfile``, which
each test points at its own ``tmp_path``). An example that cannot run here says so on its own line with
``# doctest: +SKIP``, and its docstring says why.
"""

import doctest
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# (directory in the repository, the package it installs as)
TREES = (("zinfjax", "zinfjax"), ("interop", "zinfjax_interop"), ("tests/support", "tests.support"))
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# A module whose examples change the process that runs them for good runs in a child process of its own, loaded from
# its file (a module of the standard library alone needs nothing else, and starts in a moment).
IN_A_CHILD = {
    "zinfjax.runtime.allocator": "tune_allocator sets glibc's malloc for the whole process, every later test's",
}
# Warnings a module's examples give here and nowhere else, left out while they run.
QUIET = {
    # launch forks its processes; JAX warns of a fork in a process where it has run (this one: `zinfjax launch`
    # from the command line has not)
    "zinfjax.runtime.launch": dict(action="ignore", message="os.fork", category=RuntimeWarning),
}


def modules_with_examples() -> list[str]:
    found = []
    for directory, package in TREES:
        for path in sorted((ROOT / directory).rglob("*.py")):
            if ">>>" in path.read_text():
                parts = [p for p in path.relative_to(ROOT / directory).with_suffix("").parts if p != "__init__"]
                found.append(".".join([package, *parts]))
    return found


MODULES = modules_with_examples()


def test_every_module_with_examples_is_found():
    assert len(MODULES) > 100 and {"zinfjax", "zinfjax.wrap", "zinfjax_interop.hf", "tests.support.tolerances"} \
        <= set(MODULES)
    assert set(IN_A_CHILD) | set(QUIET) <= set(MODULES)


def run_examples(name: str) -> tuple[int, int, str]:
    """``(attempted, failed, report)`` of the examples of module ``name``, run in this process."""
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(module):
        runner.run(test, out=report.append)
    return runner.tries, runner.failures, "".join(report)


CHILD = """
import doctest, importlib.util, json, sys
name, path = sys.argv[1:]
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
report = []
for test in doctest.DocTestFinder().find(module):
    runner.run(test, out=report.append)
print(json.dumps([runner.tries, runner.failures, "".join(report)]))
"""


def run_in_a_child(name: str) -> tuple[int, int, str]:
    """`run_examples` in a child process, with the warnings the tests turn into errors."""
    path = importlib.util.find_spec(name).origin
    warnings = ["-W", "error", "-W", "ignore::DeprecationWarning", "-W", "ignore::ResourceWarning"]
    out = subprocess.run([sys.executable, *warnings, "-c", CHILD, name, path], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "TMPDIR": tempfile.gettempdir()})
    assert out.returncode == 0, out.stderr[-3000:]
    return tuple(json.loads(out.stdout.splitlines()[-1]))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # examples name files by their path in the repository (examples/demo.yaml)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what they make goes with the test
    before = written(ROOT)
    with warnings.catch_warnings():
        if name in QUIET:
            warnings.filterwarnings(**QUIET[name])
        attempted, failed, report = run_in_a_child(name) if name in IN_A_CHILD else run_examples(name)
    assert attempted > 0, f"{name} has no example that runs"
    assert failed == 0, report
    assert written(ROOT) == before, "an example wrote into the repository: write into tempfile's directory"


def written(root: pathlib.Path) -> list[str]:
    """The repository's top level, and runs/ (where a run writes by default), as names."""
    runs = sorted(os.listdir(root / "runs")) if (root / "runs").is_dir() else []
    return sorted(os.listdir(root)) + [f"runs/{name}" for name in runs]
