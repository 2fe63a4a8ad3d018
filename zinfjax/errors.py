"""Errors that name a user mistake and its fix.

The CLI prints a `UserError` as one line without a traceback; anything else is a bug.
"""


class UserError(Exception):
    """A mistake in the input (config, file, path, model) that the user can fix."""


class ConfigError(UserError, ValueError):
    """A config value or key that is not allowed."""


def printable(name) -> str:
    """A key as an error message shows it: as written, or quoted with escapes when it would break the line."""
    text = str(name)
    return text if text.isprintable() and text.strip() == text and text else repr(name)
