"""The house's layering: every module in a layer, no import cycle, and the installed packages are the tree's."""

import ast
import pathlib
import re
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


# The engine runs what `zinfjax.program` hands it and never sees a jaxpr (docs/design.md, "Versions"): no JAX
# core module, no jaxpr helper, and no attribute that only an equation or a jaxpr has.
JAXPR_MODULES = ("jax.core", "jax.extend", "jax._src", "zinfjax.program.jaxpr")
JAXPR_ATTRIBUTES = frozenset({"eqn", "eqns", "jaxpr", "closed", "invars", "outvars", "constvars", "primitive"})


def _dotted(node) -> str | None:
    """``a.b.c`` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _jaxpr_uses(text: str) -> list[str]:
    """Where ``text`` (a module's source) imports or names a jaxpr module, or reads a jaxpr's attribute."""
    found = []
    for node in ast.walk(ast.parse(text)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node) or ""]
            if node.attr in JAXPR_ATTRIBUTES:
                found.append(f"{node.lineno}: .{node.attr}")
        found += [f"{node.lineno}: {n}" for n in names if any(n == m or n.startswith(m + ".") for m in JAXPR_MODULES)]
    return sorted(found, key=lambda where: int(where.split(":")[0]))


def test_the_engine_never_sees_a_jaxpr():
    found = [f"{path.relative_to(ROOT)}:{where}" for path in sorted((ROOT / "zinfjax" / "engine").rglob("*.py"))
             for where in _jaxpr_uses(path.read_text())]
    assert found == [], "the engine reads what zinfjax.program hands it (its records and stage functions), " \
                        "not these:\n" + "\n".join(found)


def test_the_jaxpr_check_finds_each_way_in():
    for leak in ("import jax.extend.core as jc", "from jax import core", "from jax._src import core",
                 "from zinfjax.program import jaxpr as jx", "x = jax.core.Var", "n = stage.eqn.params['length']",
                 "f(closed.jaxpr)", "for e in stage.eqns: pass", "v = body.outvars[0]"):
        assert _jaxpr_uses(leak), leak
    assert _jaxpr_uses("import jax\nimport jax.numpy as jnp\nx = stage.params[0]\ny = jax.typeof(x)") == []


# The engine, the store and the program take the sections of a run's config they read (`zinfjax.sections`), never the
# `Config` itself (docs/design.md, "Settings"): no import of it, no annotation naming it, and no parameter named
# ``config``, which an untyped function would take it by where import-linter cannot see it.
LOW_LAYERS = ("engine", "store", "program")


def _names_config(annotation) -> bool:
    """Whether an annotation names ``Config``: as a name, an attribute (``zinfjax.Config``) or in a string."""
    for node in ast.walk(annotation):
        if "Config" in (getattr(node, "id", None), getattr(node, "attr", None)):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"\bConfig\b", node.value):
            return True
    return False


def _is_config_module(name: str, level: int = 0) -> bool:
    return name == "zinfjax.config" or name.startswith("zinfjax.config.") or (level > 0 and name == "config")


def _config_imports(node) -> list[str]:
    """What an import statement takes of the run config: ``zinfjax.config`` (absolute or relative), or ``Config``."""
    if isinstance(node, ast.Import):
        return [f"import {a.name}" for a in node.names if _is_config_module(a.name)]
    module = node.module or ""
    found = [f"from {'.' * node.level}{module} import ..."] if _is_config_module(module, node.level) else []
    return found + [f"imports {a.name}" for a in node.names
                    if a.name == "Config" or (module == "zinfjax" and a.name == "config")]


def _config_parameters(node) -> list[str]:
    """The parameters of a function that take the run config: annotated with it, or named ``config``; its return."""
    args = node.args
    found = []
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None and arg.annotation is not None and _names_config(arg.annotation):
            found.append(f"parameter {arg.arg} annotated with Config")
        elif arg is not None and arg.arg in ("config", "cfg"):
            found.append(f"parameter {arg.arg}")
    if getattr(node, "returns", None) is not None and _names_config(node.returns):
        found.append("returns a Config")
    return found


def _config_uses(text: str) -> list[str]:
    """Where ``text`` (a module's source) imports the run config, annotates with it, or takes a ``config``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found += [f"{node.lineno}: {what}" for what in _config_imports(node)]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found += [f"{node.lineno}: {what}" for what in _config_parameters(node)]
        elif isinstance(node, ast.AnnAssign) and _names_config(node.annotation):
            found.append(f"{node.lineno}: annotated with Config")
    return sorted(found, key=lambda where: int(where.split(":")[0]))


def test_the_engine_store_and_program_take_sections_not_the_config():
    found = [f"{path.relative_to(ROOT)}:{where}" for layer in LOW_LAYERS
             for path in sorted((ROOT / "zinfjax" / layer).rglob("*.py")) for where in _config_uses(path.read_text())]
    assert found == [], "take the config's sections (zinfjax.sections) or plain values, not the Config:\n" + \
                        "\n".join(found)


def test_the_config_check_finds_each_way_in():
    for leak in ("from zinfjax.config import Config", "import zinfjax.config", "import zinfjax.config as zc",
                 "from zinfjax import Config", "from zinfjax import config", "from ..config import Config",
                 "def f(c: Config): pass", "def f(c: 'Config | None' = None): pass",
                 "def f(*, c: zinfjax.Config): pass",
                 "def f(config, n): pass", "def f(self, cfg): pass", "lambda config: config.lr",
                 "def f() -> Config: pass", "class P:\n    config: Config", "class P:\n    settings: 'list[Config]'"):
        assert _config_uses(leak), leak
    assert _config_uses("from zinfjax.sections import Memory, Tiering\n"
                        "def f(memory: Memory, model_config: ModelConfig, tiering: 'Tiering | None'): pass\n"
                        "config = pad.params['padding_config']\nx = jax.config.jax_enable_x64") == []
