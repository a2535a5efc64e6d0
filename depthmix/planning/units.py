"""Bytes and counts as people read them: the one formatter of each."""

from __future__ import annotations

import math
from typing import Optional

GIB = 2**30
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float, unit: Optional[str] = None, digits: int = 2) -> str:
    """``n`` bytes in ``unit`` (one of :data:`BYTE_UNITS`), else in the largest unit that
    keeps the number at or above 1; whole bytes have no decimals."""
    if unit is not None:
        power = BYTE_UNITS.index(unit)
    else:
        power = 0
        while power + 1 < len(BYTE_UNITS) and abs(n) >= 1024 ** (power + 1):
            power += 1
    if power == 0:
        return f"{n:.0f} B"
    return f"{n / 1024**power:.{digits}f} {BYTE_UNITS[power]}"


def human(n: float) -> str:
    """A count with a K/M/B/T suffix: ``2.75B``."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}" if math.isfinite(n) else str(n)
