"""Memory sizes: parse "4GiB"-style budgets, print byte counts, read the machine's RAM.

Units: "K", "M", "G", "T" with or without a trailing "B" are decimal (1e3 .. 1e12, as disk vendors count);
"KiB", "MiB", "GiB", "TiB" are binary (2**10 .. 2**40). Plain digits (or a trailing "B") are bytes.
"""

from __future__ import annotations

import os
import re
from decimal import Decimal, InvalidOperation

from .errors import SpecOffloadError

_EXAMPLES = '"4GiB", "512MiB", "1.5GB", "2G" or a plain byte count such as 1073741824'

#: lower-case unit suffix -> bytes per unit
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{p: 1000**i for i, p in enumerate(("k", "m", "g", "t"), start=1)},
    **{p + "b": 1000**i for i, p in enumerate(("k", "m", "g", "t"), start=1)},
    **{p + "ib": 1024**i for i, p in enumerate(("k", "m", "g", "t"), start=1)},
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)

#: binary units for `format_bytes`, largest first
_BINARY = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


class MemorySizeError(SpecOffloadError, ValueError):
    """A memory size (a budget on the command line or in a config) could not be parsed."""


def parse_bytes(value: int | str) -> int:
    """A byte count from an int (>= 0) or a string such as "4GiB", "512 MiB", "1.5GB", "2g", "1024"."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MemorySizeError(f"memory size must be an int or a string, got {value!r}; use e.g. {_EXAMPLES}")
    if isinstance(value, int):
        if value < 0:
            raise MemorySizeError(f"memory size must be >= 0, got {value}; use e.g. {_EXAMPLES}")
        return value
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise MemorySizeError(f"cannot parse memory size {value!r}; use e.g. {_EXAMPLES}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # the regex admits only valid decimals; kept as a guard
        raise MemorySizeError(f"cannot parse memory size {value!r}; use e.g. {_EXAMPLES}") from exc
    scale = _UNITS[unit]
    if scale == 1 and number != number.to_integral_value():
        raise MemorySizeError(f"memory size {value!r} is a fraction of a byte; use e.g. {_EXAMPLES}")
    return int(number * scale)  # whole bytes, rounded down


def format_bytes(n: int) -> str:
    """Human-readable binary size: "12 B", "512.0 MiB", "1.50 GiB" (2 decimals below 10, else 1)."""
    if n < 0:
        return "-" + format_bytes(-n)
    for name, scale in _BINARY:
        if n >= scale:
            value = n / scale
            return f"{value:.2f} {name}" if value < 10 else f"{value:.1f} {name}"
    return f"{n} B"


def machine_memory_bytes() -> int:
    """Total physical RAM of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
