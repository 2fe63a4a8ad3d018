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


def test_design_md_numbers_the_four_invariants():
    text = (ROOT / "docs" / "design.md").read_text()
    for n, name in enumerate(["Exact", "Bounded memory", "Ordered", "Nothing lost"], start=1):
        assert f"{n}. **{name}.**" in text
