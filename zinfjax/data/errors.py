"""The error of a data source that cannot be read or does not fit the model."""

from __future__ import annotations

from zinfjax.errors import UserError


class DataError(UserError):
    """A data source that cannot be read or does not fit the model."""
