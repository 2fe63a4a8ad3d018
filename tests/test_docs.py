"""The docs name what the code has: every Config key in docs/config.md, every module in docs/design.md."""

import dataclasses
import pathlib
import re

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


def test_no_file_cites_a_tracker_number():
    """Docs, code and tests say what is so and why, not which ticket asked for it: no issue numbers."""
    cited = re.compile(r"\bissue\s+#?\d+|\bissues\s+#\d+", flags=re.I)  # "issues 4 MiB requests" is a verb
    paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    paths += [p for d in ("zinfjax", "interop", "tests", "bench", "examples") for p in (ROOT / d).rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in paths for m in cited.finditer(p.read_text())]
    assert not found, f"tracker numbers cited: {found}"


def test_readme_status_names_as_not_yet_only_what_is_not_yet():
    """LoRA's adapter-only checkpoints, ``lora_dropout`` and PEFT export and import work (tests/interop/test_peft.py,
    tests/training/test_finetune_base.py): the README's status does not list them as not done."""
    status = (ROOT / "README.md").read_text().split("## Status", 1)[1].split("\n## ", 1)[0]
    not_yet = " ".join(p for p in status.split("\n\n") if p.startswith("Not yet"))
    assert not_yet and not re.search(r"lora_dropout|PEFT|adapter-only", not_yet), not_yet
    assert re.search(r"lora_dropout", status) and re.search(r"PEFT export and import", status)
