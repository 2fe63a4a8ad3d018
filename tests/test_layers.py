"""The house's layering: every module in a layer, no import cycle, and the installed packages are the tree's."""

import ast
import pathlib
import tomllib

import grimp

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _layers() -> set[str]:
    contract = next(c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def test_every_top_level_module_of_zinfjax_sits_in_a_layer():
    children = {p.stem for p in (ROOT / "zinfjax").glob("*.py") if p.stem != "__init__"}
    children |= {p.parent.name for p in (ROOT / "zinfjax").glob("*/__init__.py")}
    assert children - _layers() == set(), "add these to the layers contract in pyproject.toml"
    assert _layers() - children == set(), "the layers contract names modules the tree does not have"


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycle_between_zinfjax_modules():
    graph = grimp.build_graph("zinfjax", "zinfjax_interop")
    assert _cycles(graph, {m for m in graph.modules if m.startswith("zinfjax")}) == []  # package __init__s too


def test_the_cycle_check_finds_a_cycle():
    graph = grimp.ImportGraph()
    for m in ("a.x", "a.y", "a.z"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    assert _cycles(graph, {"a.x", "a.y", "a.z"}) == []
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph, {"a.x", "a.y", "a.z"}) == [{"a.x", "a.y", "a.z"}]


def test_the_installed_packages_are_the_trees():
    setuptools = PYPROJECT["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "zinfjax").rglob("__init__.py")}
    assert set(setuptools["packages"]) == tree | {"zinfjax_interop"}
    assert setuptools["package-dir"] == {"zinfjax_interop": "interop"}  # nothing installs a top-level `interop`


def test_no_module_over_600_lines_and_no_function_over_60():
    too_long = []
    for path in sorted([*(ROOT / "zinfjax").rglob("*.py"), *(ROOT / "interop").rglob("*.py")]):
        text = path.read_text()
        if len(text.splitlines()) > 600:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert too_long == []
