"""The docs name what the code has: every Config key in docs/config.md, every module in docs/design.md, and only
paths, modules, names and config keys that exist; and every command they show a user runs in a test, or says it is
illustrative."""

import ast
import dataclasses
import functools
import os
import pathlib
import re
import shlex

import zinfjax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_config_md_lists_every_config_key():
    text = (ROOT / "docs" / "config.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    missing = [f.name for f in dataclasses.fields(zinfjax.Config) if f.name not in listed]
    assert not missing, f"docs/config.md's table of keys lacks {missing}"


def test_design_md_maps_every_module():
    text = (ROOT / "docs" / "design.md").read_text()
    mapped = set(re.findall(r"^- `([\w/]+\.py)`: \S", text, flags=re.M))
    modules = {str(p.relative_to(ROOT)) for package in ("zinfjax", "interop") for p in (ROOT / package).rglob("*.py")}
    assert not modules - mapped, f"docs/design.md's module map lacks {sorted(modules - mapped)}"
    assert not mapped - modules, f"docs/design.md's module map names missing modules {sorted(mapped - modules)}"


# ---- every module, file and config key the docs name exists ---------------------------------------------------------

PACKAGES = {"zinfjax": ROOT / "zinfjax", "zinfjax_interop": ROOT / "interop"}
# A path in the repository: zinfjax/engine/units.py, tests/test_docs.py::test_name, examples/models/*.yaml.
DOC_PATH = re.compile(r"(?<![\w/.-])((?:zinfjax|interop|tests|bench|examples|docs)/[\w./*-]*[\w*])(?:::(\w+))?")
# A dotted name: zinfjax.engine.units, zinfjax.sharding.PERSISTENCE_THRESHOLD, zinfjax_interop.load_hf.
DOTTED = re.compile(r"(?<![\w/.-])(zinfjax(?:_interop)?(?:\.\w+)+)")
FILE_NAMES = {"zinfjax.json"}  # the checkpoint's metadata file: a name with a dot that is no module
# ``--set key=value`` anywhere (config.md's own ``--set key=value`` names no key); ``key=value`` in backticks; a
# Config(...) keyword or a "key=value" override in a Python block.
SET_KEY = re.compile(r"--set[ =]+['\"]?(\w+)=(?!value\b)")
BACKTICKED = re.compile(r"`([^`\n]+)`")
ASSIGNED = re.compile(r"^([a-z]\w*)=\S")  # an environment variable (ZINFJAX_PLAN_PROBE=0) is no key
IDENTIFIER = re.compile(r"(?<![\w./:$-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w(/])")
PY_CONFIG_KEYWORD = re.compile(r"\bConfig\(([^)]*)\)")
PY_OVERRIDE = re.compile(r"[\"'](\w+)=[^\"']*[\"']")
# Names the docs use that no code of this project holds: the kernel's, XLA's, and the variables of formulas.
OUTSIDE = {
    "max_ptes_none": "the kernel's khugepaged setting",
    "clear_page_erms": "the kernel's page-zeroing function, in a profile",
    "dma_alignment": "the kernel's block-queue attribute",
    "dot_bf16_bf16_fp32": "an XLA CPU kernel, in a profile",
    "gamma_n": "Higham's rounding bound, in a formula",
    "tokens_per_device": "a variable of the machine plan's formula",
    "host_rate": "a variable of an earlier cost model's formula",
    "nvme_rate": "a variable of an earlier cost model's formula",
    "nvme_read": "a variable of the cost model's formula",
    "nvme_write": "a variable of the cost model's formula",
    "sum_t": "a sum over tiles, in a formula",
    "fan_avg": "a mode of jax.nn.initializers.variance_scaling",
    "missed_heartbeat_callback": "an argument of jax.distributed.initialize",
}


def _module_file(parts: list[str]) -> tuple[pathlib.Path, int] | None:
    """The file of the longest module prefix of a dotted name, and how many parts it took."""
    base = PACKAGES.get(parts[0])
    if base is None:
        return None
    here, i = base, 1
    while i < len(parts) and ((here / parts[i]).is_dir() or (here / f"{parts[i]}.py").is_file()):
        here, i = (here / parts[i]) if (here / parts[i]).is_dir() else (here / f"{parts[i]}.py"), i + 1
    return (here / "__init__.py" if here.is_dir() else here), i


@functools.cache
def _defined(path: pathlib.Path) -> dict:
    """The names a module defines at its top level, each class with the names its body defines: ``{name: inner}``,
    an import as ``("import", module, name)`` to follow."""
    def collect(body) -> dict:
        names = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names[node.name] = {}
            elif isinstance(node, ast.ClassDef):
                names[node.name] = collect(node.body)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update({n.id: {} for n in ast.walk(target) if isinstance(n, ast.Name)})
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.update({a.asname or a.name: ("import", node.module, a.name) for a in node.names})
            elif isinstance(node, ast.Import):
                names.update({(a.asname or a.name).split(".")[0]: {} for a in node.names})
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                names.update(collect(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])))
        return names

    return collect(ast.parse(path.read_text()).body)


def resolves(dotted: str) -> bool:
    """Whether a dotted name is a module of zinfjax (or zinfjax_interop), or a name defined in one: a function,
    class, constant, a class's method or attribute, or a name a package imports from another module."""
    parts = dotted.split(".")
    found = _module_file(parts)
    if found is None or not found[0].is_file():
        return False
    path, i = found
    scope = _defined(path)
    for name in parts[i:]:
        inner = scope.get(name) if isinstance(scope, dict) else None
        if isinstance(inner, tuple):  # imported: follow it to where it is defined
            module = inner[1].replace("zinfjax_interop", "zinfjax_interop")
            return resolves(".".join([module, inner[2], *parts[parts.index(name) + 1:]]))
        if inner is None:
            return False
        scope = inner
    return True


@functools.cache
def code_names() -> tuple[frozenset, frozenset, frozenset]:
    """What the project's code names: (every identifier, and every word of a string that is not a docstring;
    every parameter, keyword argument and class attribute; every ``key=`` a string of the code writes)."""
    words, keywords, written = set(), set(), set()
    for d in ("zinfjax", "interop", "tests", "bench", "examples"):
        for path in (ROOT / d).rglob("*.py"):
            words.add(path.stem)
            if path == pathlib.Path(__file__).resolve():  # its planted names are not the project's
                continue
            tree = ast.parse(path.read_text())
            docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)
                          and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Name):
                    words.add(node.id)
                elif isinstance(node, ast.Attribute):
                    words.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    words.add(node.name)
                elif isinstance(node, ast.arg):
                    words.add(node.arg)
                    keywords.add(node.arg)
                elif isinstance(node, ast.keyword) and node.arg:
                    words.add(node.arg)
                    keywords.add(node.arg)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    words.update(re.findall(r"\w+", node.value))
                    written.update(re.findall(r"(\w+)=", node.value))
                if isinstance(node, ast.ClassDef):
                    keywords.update(n.target.id for n in node.body
                                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
        for path in (ROOT / d).rglob("*.yaml"):
            words.update(re.findall(r"\w+", path.read_text()))
    return frozenset(words), frozenset(keywords), frozenset(written)


def config_keys() -> set[str]:
    return {f.name for f in dataclasses.fields(zinfjax.Config)}


def stale_names(text: str) -> list[str]:
    """What a doc names that the project does not have: a path, a module or a name in one, a config key."""
    keys = config_keys()
    words, keywords, written = code_names()
    stale = []
    for m in DOC_PATH.finditer(text):
        path, test = m.group(1).rstrip("."), m.group(2)
        matches = sorted(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
        if not matches:
            stale.append(f"no file {path}")
        elif test and not re.search(rf"^(?:async )?def {test}\(", matches[0].read_text(), flags=re.M):
            stale.append(f"no test {path}::{test}")
    for m in DOTTED.finditer(text):
        if m.group(1) not in FILE_NAMES and not resolves(m.group(1)):
            stale.append(f"no module or name {m.group(1)}")
    stale += [f"no config key {k} (--set)" for k in SET_KEY.findall(text) if k not in keys]
    for m in BACKTICKED.finditer(text):
        inner = m.group(1)
        assigned = ASSIGNED.match(inner)
        if assigned and assigned.group(1) not in keys | keywords | written | set(OUTSIDE):
            stale.append(f"no config key or keyword {assigned.group(1)} (`{inner}`)")
        for name in IDENTIFIER.findall(inner):
            if name not in keys | words | set(OUTSIDE):
                stale.append(f"no name {name} (`{inner}`)")
    for info, body in FENCE.findall(text):
        if info.split()[:1] == ["python"]:
            for args in PY_CONFIG_KEYWORD.findall(body):
                stale += [f"no config key {k} (Config)" for k in re.findall(r"(\w+)=", args) if k not in keys]
            for line in body.splitlines():
                if "Config" in line:
                    stale += [f"no config key {k} (override)" for k in PY_OVERRIDE.findall(line) if k not in keys]
    return stale


def test_the_docs_name_only_modules_files_and_config_keys_that_exist():
    """Every path (``zinfjax/engine/units.py``, ``tests/x.py::test_y``), module or name in one
    (``zinfjax.sharding.PERSISTENCE_THRESHOLD``), config key (``--set key=value``, a backticked ``key=value``, a
    ``Config(key=...)``) and backticked identifier of README.md and docs/*.md is in the project: a name the code
    renamed or removed is caught where a doc still names it."""
    found = {str(p.relative_to(ROOT)): stale_names(p.read_text()) for p in doc_paths()}
    assert {doc: names for doc, names in found.items() if names} == {}
    config_md = (ROOT / "docs" / "config.md").read_text()
    keys_section, deepspeed = config_md.split("## Keys", 1)[1].split("\n## DeepSpeed", 1)
    table = re.findall(r"^\| `(\w+)` \|", keys_section, flags=re.M)
    assert table and set(table) - config_keys() == set(), "docs/config.md's table lists keys Config lacks"
    rows = re.findall(r"^\|[^|]*\| (.*) \|$", deepspeed, flags=re.M)  # the zinfjax column
    mapped = {k for row in rows for k in re.findall(r"`(\w+)`", row)}
    assert mapped and mapped - config_keys() - {"device", "host", "nvme"} == set(), \
        "docs/config.md maps DeepSpeed keys onto keys Config lacks"
    from zinfjax._util.deepspeed_config import NO_EFFECT

    listed = {section: set(re.findall(r"`(\w+)`", names))
              for section, names in re.findall(r"^- `(\w+)`: (.*)$", deepspeed, flags=re.M)}
    assert listed == NO_EFFECT, "docs/config.md's DeepSpeed keys without effect are not the ones accepted so"


def test_the_code_names_only_docs_modules_and_names_that_exist():
    """The code's docstrings, comments and messages name files that exist (``docs/engine.md``,
    ``zinfjax/engine/units.py``) and, in backticks, modules and names that exist (```zinfjax.store.nvme.NvmeStore```).
    Paths without a file's suffix are left out (``zinfjax/heartbeat/``, a key prefix), and so are dotted names
    outside backticks (``zinfjax.get(...)`` on a dict named so)."""
    this = pathlib.Path(__file__).resolve()
    stale = []
    for d in ("zinfjax", "interop", "tests", "bench", "examples"):
        for path in sorted((ROOT / d).rglob("*.py")):
            if path == this:
                continue
            text = path.read_text()
            for m in DOC_PATH.finditer(text):
                named = m.group(1).rstrip(".")
                if re.search(r"\.(py|md|yaml|json|txt)$", named) and not (
                        sorted(ROOT.glob(named)) if "*" in named else (ROOT / named).exists()):
                    stale.append(f"{path.relative_to(ROOT)}: no file {named}")
            for m in re.finditer(r"`+(zinfjax(?:_interop)?(?:\.\w+)+)`", text):
                if m.group(1) not in FILE_NAMES and not resolves(m.group(1)):
                    stale.append(f"{path.relative_to(ROOT)}: no module or name {m.group(1)}")
    assert stale == []


def test_the_name_check_finds_what_is_stale_and_only_that():
    """The check above on planted text: each stale form is caught, and the same forms naming what exists pass."""
    stale = ["see zinfjax/engine/functions.py", "`zinfjax.engine.functions`", "`zinfjax.store.NvmeStore`'s",
             "zinfjax.sharding.PERSISTENCE_LIMIT", "`zinfjax.Config.no_such_method`",
             "tests/test_docs.py::test_no_such_test", "examples/models/no-such-*.yaml",
             "--set persistence_threshold=1", "`readahead_layers=2`", "the `host_copy_bw` rate",
             "```python\nconfig = Config(stage=3, no_such_key=1)\n```",
             "```python\nConfig.load(None, [\"stages=3\"])\n```"]
    fine = ["see zinfjax/engine/units.py", "`zinfjax.engine.units`", "`zinfjax.store.nvme.NvmeStore`'s",
            "zinfjax.sharding.PERSISTENCE_THRESHOLD", "`zinfjax.Config.load`", "zinfjax.models.tile_kernel",
            "tests/test_docs.py::test_no_file_cites_a_tracker_number", "examples/models/zero-infinity-*.yaml",
            "--set stage=3", "`--set key=value`", "`prefetch_depth=2`", "the `host_copy_GBps` rate",
            "`reuse_reads=False`", "`io_floor=1.31x`", "`zinfjax.json`", "zinfjax_interop.load_hf",
            "```python\nconfig = Config(stage=3, nvme_path='/nv')\n```",
            "```python\nConfig.load(None, [\"stage=3\"])\n```"]
    assert [s for s in stale if not stale_names(s)] == []
    assert {s: stale_names(s) for s in fine if stale_names(s)} == {}


CITATION = re.compile(r"\binvariants?\s+(\d+(?:(?:\s*,\s*|\s+and\s+|\s+or\s+)\d+)*)", flags=re.I)


def stated_invariants() -> dict[int, str]:
    """The invariants docs/design.md states: its "## Invariants" section's numbered list, number -> name."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = re.search(r"^## Invariants\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert section, "docs/design.md has no \"## Invariants\" section"
    stated = [(int(n), name) for n, name in re.findall(r"^(\d+)\. \*\*([^*]+?)\.?\*\*", section.group(1), flags=re.M)]
    assert [n for n, _ in stated] == list(range(1, len(stated) + 1)), f"invariants not numbered 1, 2, ...: {stated}"
    return dict(stated)


def citations(path: pathlib.Path) -> set[int]:
    """The invariant numbers a file cites: "invariant 2", "Invariant 1:", "invariants 3 and 4"."""
    return {int(n) for m in CITATION.finditer(path.read_text()) for n in re.findall(r"\d+", m.group(1))}


def test_every_invariant_is_enforced_by_a_test_and_every_citation_names_one():
    """Each invariant of docs/design.md is cited by a test module that checks it, and no file cites one it lacks."""
    stated = stated_invariants()
    assert stated, "docs/design.md states no invariants"
    this = pathlib.Path(__file__).resolve()
    tests = [p for p in sorted((ROOT / "tests").rglob("test_*.py")) if p != this and "\ndef test_" in p.read_text()]
    enforced = {n: [p.name for p in tests if n in citations(p)] for n in stated}
    unenforced = [f"{n} ({stated[n]})" for n, names in enforced.items() if not names]
    assert not unenforced, f"invariants of docs/design.md that no test module cites: {unenforced}"
    files = [ROOT / "README.md"] + [p for d in ("zinfjax", "interop", "tests", "docs", "bench", "examples")
                                    for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".md")]
    wrong = {str(p.relative_to(ROOT)): sorted(citations(p) - set(stated)) for p in files if p != this}
    wrong = {path: numbers for path, numbers in wrong.items() if numbers}
    assert not wrong, f"citations of invariants docs/design.md does not state (it states 1-{len(stated)}): {wrong}"


# A citation of a tracker's ticket: "issue 15", "Issue #35", "issues #4 and #5", "ticket 7", "PR 12", "GH-9", "(#48)",
# "see #48", or a ticket named without its number ("the model", "this ticket"). Not: "issues 4 MiB requests"
# (a verb), "issue order", a format spec ("{x:#010x}") or a name in quotes ("read params_blocks #2", a trace lane).
TRACKER = re.compile(
    r"\bissues?\s+#\d+|\bissue\s+\d+|\b(?:ticket|bug|pr|pull request)s?\s+#?\d+|\bgh-\d+"
    r"|(?:^|(?<=[\s(\[,;]))#\d+\b(?![\"'\w])"
    r"|\b(?:the|this|that|an?|which|whose) (?:issue|ticket)(?:'s|s'?)?(?= (?:asks?|asked|says?|said|wants?|wanted|"
    r"table|model|title|point|number|list|text|brief))"
    r"|\b(?:the|this|that) (?:issue|ticket)'s\b",
    flags=re.I | re.M)


def test_the_tracker_pattern_finds_each_form_and_only_those():
    cited = ["issue 15", "Issue #35", "as issues #4 and #5 ask", "ticket 7", "PR 12", "pull request 3", "gh-9",
             "(#48)", "see #48.", "#48: the fix", "the issue's model", "This ticket's point", "the issue asks for",
             "bug 12"]
    clean = ["the tier issues 4 MiB requests", "in issue order", "f'{x:#010x}'", '"read params_blocks #2"',
             "an issue with the disk", "# 48 bytes", "issue_t", "color #fff", "the issues raised by a bad path"]
    assert [c for c in cited if not TRACKER.search(c)] == []
    assert [c for c in clean if TRACKER.search(c)] == []


def tracked_text_files() -> list[pathlib.Path]:
    """Every text file of the project: code, tests, docs, examples, benchmarks and the build's files."""
    skip = {".git", ".venv", ".cache", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build",
            "dist"}
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".txt", ".cfg", ".sh", ".ini"}
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        found += [pathlib.Path(top, f) for f in files if pathlib.Path(f).suffix in suffixes or f in ("Makefile", "run")]
    return sorted(found)


def test_no_file_cites_a_tracker_number():
    """Docs, code and tests say what is so and why, not which ticket asked for it: no issue numbers, and no ticket
    named in their stead."""
    this = pathlib.Path(__file__).resolve()
    paths = tracked_text_files()
    assert {ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "zinfjax" / "wrap.py"} <= set(paths)
    found = [f"{p.relative_to(ROOT)}:{p.read_text().count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for p in paths if p != this for m in TRACKER.finditer(p.read_text(errors="replace"))]
    assert not found, f"tracker numbers cited: {found}"


def test_readme_status_names_as_not_yet_only_what_is_not_yet():
    """LoRA's adapter-only checkpoints, ``lora_dropout`` and PEFT export and import work (tests/interop/test_peft.py,
    tests/training/test_finetune_base.py): the README's status does not list them as not done."""
    status = (ROOT / "README.md").read_text().split("## Status", 1)[1].split("\n## ", 1)[0]
    not_yet = " ".join(p for p in status.split("\n\n") if p.startswith("Not yet"))
    assert not_yet and not re.search(r"lora_dropout|PEFT|adapter-only", not_yet), not_yet
    assert re.search(r"lora_dropout", status) and re.search(r"PEFT export and import", status)


# ---- every command a user would copy from the docs runs in a test, or says it is illustrative ----------------------

SHELL_BLOCKS = ("bash", "sh", "shell", "console")
# The words a shell command starts with, after any VAR=value assignments: what no other kind of block may hold.
PROGRAMS = re.compile(r"^(?:\w+=\S*\s+)*(zinfjax|make|python3?|pip|pytest|apt-get|cd|srun|time|bash"
                      r"|\S+/(?:zinfjax|python3?|pytest))(?:\s|$)")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", flags=re.M | re.S)
HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?")


def doc_paths() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def split_comment(line: str) -> tuple[str, str]:
    """``line`` cut at its shell comment (a ``#`` outside quotes, at the start or after white space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def block_commands(body: str, console: bool, illustrative_block: bool) -> list[tuple[str, bool]]:
    """The commands of a shell block, each as (normalized text, illustrative): see the rule in
    `test_every_doc_command_runs_in_a_test_or_is_illustrative`. In a console block only the ``$ `` lines are
    commands; the rest is their output."""
    commands, lines, i = [], body.splitlines(), 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if console and not line.startswith("$ "):
            continue
        text, comment = split_comment(line.removeprefix("$ "))
        while text.endswith("\\") and i < len(lines):
            text, comment = split_comment(text[:-1] + " " + lines[i].strip())
            i += 1
        if not text:
            continue
        heredoc = HEREDOC.search(text)
        while heredoc and i < len(lines) and lines[i].strip() != heredoc[1]:  # its body is input, not commands
            i += 1
        i += 1 if heredoc else 0
        commands.append((" ".join(text.split()), illustrative_block or bool(re.search(r"\billustrative\b", comment))))
    return commands


def doc_commands() -> dict[str, list[tuple[str, bool]]]:
    """Every shell command of README.md and docs/*.md: doc -> [(normalized text, illustrative)]."""
    found = {}
    for path in doc_paths():
        for info, body in FENCE.findall(path.read_text()):
            words = info.split()
            if words and words[0] in SHELL_BLOCKS:
                found.setdefault(str(path.relative_to(ROOT)), []).extend(
                    block_commands(body, words[0] == "console", "illustrative" in words[1:]))
    return found


def named_in(command: str) -> list[str]:
    """What a test that runs ``command`` must name in its file: the subcommand (or script, or make target), each
    ``--option`` and each ``--set`` key."""
    words = shlex.split(command)
    while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the program
        words = words[1:]
    program, rest = os.path.basename(words[0]), words[1:]
    first = next((w for w in rest if not w.startswith("-")), None)  # the subcommand, script, test file or target
    names = [os.path.basename(first)] if first and program in ("zinfjax", "make", "python", "pytest") else []
    names += [rest[1]] if program == "zinfjax" and rest[:1] in (["bench"], ["ckpt"]) and len(rest) > 1 else []
    names += [w.split("=")[0] for w in rest if w.startswith("--") and w not in ("--", "--set")]
    names += [value.split("=")[0] for flag, value in zip(rest, rest[1:], strict=False) if flag == "--set"]
    return names


def test_every_doc_command_runs_in_a_test_or_is_illustrative():
    """Every shell command of README.md and docs/*.md is run by a test that tests/doc_commands.py names, or its doc
    marks it illustrative.

    The commands: the lines of fenced blocks whose info string starts with ``bash``, ``sh``, ``shell`` or
    ``console`` (in a console block, only its ``$ `` lines), a line ending in ``\\`` joined with the next, comment
    lines and a heredoc's body left out, the trailing comment dropped and the white space made single. A command is
    illustrative when its trailing comment has the word ``illustrative`` (README.md writes ``(illustrative)``), or
    its block's info string does (```` ```bash illustrative ````). The table fails this test when it leaves a
    command out, names a test that does not exist (its file holds no ``def test_name(``) or a file that does not
    name what the command gives (`named_in`), or lists a command no doc holds any more (or that is illustrative
    now); a command both listed and illustrative fails too."""
    from tests.doc_commands import RUN_BY

    found = [(doc, command, ill) for doc, commands in doc_commands().items() for command, ill in commands]
    illustrative = {command for _, command, ill in found if ill}
    runnable = {command for _, command, ill in found if not ill}
    unlisted = sorted(f"{doc}: {command}" for doc, command, ill in found if not ill and command not in RUN_BY)
    assert not unlisted, f"doc commands no test runs (list them in tests/doc_commands.py, or mark them " \
                         f"illustrative): {unlisted}"
    stale = sorted(set(RUN_BY) - runnable)
    assert not stale, f"tests/doc_commands.py lists commands no doc shows (or shows as illustrative): {stale}"
    for command, test in RUN_BY.items():
        path, _, name = test.partition("::")
        text = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        assert f"\ndef {name}(" in text, f"{test} (for {command!r}) does not exist"
        unnamed = [n for n in named_in(command) if n != os.path.basename(path)  # pytest FILE: that file's test
                   and not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]
        assert not unnamed, f"{path} runs {command!r}, but never names {unnamed}"
    print(f"\ndoc commands: {len(runnable | illustrative)}: {len(runnable)} run by tests "
          f"({len(set(RUN_BY.values()))} tests), {len(illustrative)} illustrative")


def test_no_command_hides_outside_a_shell_block():
    """A fenced block that is not a shell block (output, a layout, Python, YAML) holds no line that starts a shell
    command, so that no command a user copies escapes the test above."""
    hidden = []
    for path in doc_paths():
        for info, body in FENCE.findall(path.read_text()):
            words = info.split()
            if not (words and words[0] in SHELL_BLOCKS) and words[:1] != ["python"]:
                hidden += [f"{path.relative_to(ROOT)}: {line.strip()}" for line in body.splitlines()
                           if PROGRAMS.match(line.strip())]
    assert not hidden, f"commands outside a ```bash block: {hidden}"
