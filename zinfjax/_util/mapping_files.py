"""JSON and YAML files of keys to values, read strictly: a key given twice is an error, not the last one kept.

Config files, model files, Hugging Face configs and mapping files are all read here, so every layer
(models included) can read one without importing the run config.

Example:
    >>> read_mapping("examples/demo.yaml")["model"]
    'gpt2-mini'
    >>> parse_problem(ValueError("Expecting value: line 1 column 1 (char 0)"))
    'Expecting value: line 1 column 1 (char 0)'
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

from zinfjax.errors import ConfigError


def read_mapping(path: str, what: str = "config file", error: type[Exception] = ConfigError) -> dict[str, Any]:
    """Reads a JSON or YAML file into a dict; errors (of type ``error``) name the file as ``what``.

    Example:
        >>> read_mapping("examples/demo.yaml")["model"]
        'gpt2-mini'
    """
    if not os.path.isfile(path):
        raise error(f"{what} {path!r} does not exist")
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{what} {path!r} cannot be read: {getattr(err, 'strerror', None) or err}") from err
    try:
        if path.endswith(".json"):
            values = json.loads(text, object_pairs_hook=_unique_pairs)
        else:
            values = yaml.load(text, Loader=UniqueKeyLoader)
    except (ValueError, yaml.YAMLError) as err:  # json.JSONDecodeError and DuplicateKeyError are ValueErrors
        raise error(f"{what} {path!r} cannot be parsed: {parse_problem(err)}") from err
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise error(f"{what} {path!r} must hold a mapping of keys to values")
    return values


class DuplicateKeyError(ValueError):
    """A key given twice in one mapping of a JSON or YAML file (both parsers would keep the last silently)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} is given twice in one object; keep one")
        out[key] = value
    return out


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may override keys; that is YAML's meaning, not a mistake
            key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
            try:
                if key in lines:
                    raise DuplicateKeyError(f"key {key!r} is given twice (lines {lines[key]} and {line}); keep one")
                lines[key] = line
            except TypeError:
                continue  # an unhashable key: the safe loader's own error names it
        return super().construct_mapping(node, deep)


def parse_problem(err: Exception) -> str:
    """One line on what a JSON or YAML parser found wrong, and where."""
    problem = getattr(err, "problem", None)
    if problem is None:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    mark = getattr(err, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem
