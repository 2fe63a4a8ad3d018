"""The docs name what the code has: every Config key in docs/config.md, every module in docs/design.md; and every
command they show a user runs in a test, or says it is illustrative."""

import dataclasses
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
