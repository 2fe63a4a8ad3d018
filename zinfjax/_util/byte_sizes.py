"""Byte sizes written the way people write them: ``2GiB``, ``512MiB``, ``1e9``."""

import re

from zinfjax.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int | float) -> int:
    """Parses a byte count such as ``"2GiB"``, ``"1.5GB"`` or ``4096``.

    Example:
        >>> parse_bytes("2GiB")
        2147483648
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"not a byte size: {value!r}; write e.g. 4096, 512MiB, 2GiB or 1.5GB")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        number, unit = value, ""
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"not a byte size: {value!r}; write e.g. 4096, 512MiB, 2GiB or 1.5GB")
        number, unit = match.group(1), match.group(2).lower()
    try:
        return int(float(number) * _UNITS[unit])
    except (ValueError, OverflowError) as err:  # not a number, or inf / nan
        raise ConfigError(f"not a byte size: {value!r}; write e.g. 4096, 512MiB, 2GiB or 1.5GB") from err


def format_bytes(n: float) -> str:
    """A short human form: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
