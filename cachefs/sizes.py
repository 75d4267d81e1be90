"""Byte sizes as people write them ("500G", "1.5T", "200MiB", "10GB") and as we print them.

One letter or an IEC suffix is binary (G = GiB = 2**30), the way df, du and
rclone read it; a two-letter SI suffix is decimal (GB = 10**9), the way disk
vendors and systemd read it.
"""

from __future__ import annotations

import re

_BINARY = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes in ``text``; ValueError naming the accepted forms when it does not parse."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"{text} is negative")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size (try 500G, 1.5T, 200MiB, 10GB or plain bytes)")
    number, suffix = float(match.group(1)), match.group(2).lower()
    if suffix.endswith("ib"):
        suffix = suffix[:-2]
    elif suffix == "b":
        suffix = ""
    if suffix in _BINARY:
        factor = _BINARY[suffix]
    elif suffix in _DECIMAL:
        factor = _DECIMAL[suffix]
    else:
        raise ValueError(f"{text!r} has an unknown unit (try K, M, G, T, KiB..TiB or KB..TB)")
    return int(number * factor)


def format_bytes(count: float) -> str:
    """``1536`` -> ``1.5 KiB``: binary units, three significant digits."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
