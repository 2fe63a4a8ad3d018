"""The public API is chosen: ``zinfjax.__all__`` is docs/api.md's list, every name in it exists, and the errors
a user can cause are `UserError`s."""

import pathlib
import re
import tomllib

import zinfjax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_all_is_the_documented_api():
    documented = re.findall(r"^- `(\w+)`: \S", (ROOT / "docs" / "api.md").read_text(), flags=re.M)
    assert sorted(documented) == sorted(set(documented)), "docs/api.md lists a name twice"
    assert set(zinfjax.__all__) == set(documented)
    missing = [name for name in zinfjax.__all__ if not hasattr(zinfjax, name)]
    assert missing == []


def test_every_exported_error_but_the_stores_base_is_a_user_error():
    errors = [getattr(zinfjax, n) for n in zinfjax.__all__ if n.endswith("Error")]
    assert len(errors) >= 10
    assert [e.__name__ for e in errors if not issubclass(e, zinfjax.UserError)] == ["StoreError"]
    fixable = [e for e in vars(zinfjax.store.errors).values() if isinstance(e, type) and issubclass(e, Exception)]
    assert {e.__name__ for e in fixable if issubclass(e, zinfjax.UserError)} >= {"StorePathError", "StoreSpaceError"}


def test_the_version_is_pyprojects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert zinfjax.__version__ == project["version"]
