"""Byte units: the one place for KiB/MiB/GiB, parsing sizes from flags and formatting them."""

from __future__ import annotations

import re

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


def fmt_bytes(n: float) -> str:
    """Human-readable bytes in binary units: `1.50 GiB`, `12.00 MiB`, `512 B`."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_gib(n: float, decimals: int | None = None) -> str:
    """Bytes as a number of GiB for tables: `decimals` fixed digits, or (None) one decimal from 1 GiB up and two
    significant digits below (small plans stay readable); nan stays nan."""
    v = n / GiB
    if decimals is not None:
        return f"{v:.{decimals}f}"
    return f"{v:.1f}" if v >= 1 or v == 0 or v != v else f"{v:.2g}"


def parse_bytes(text: str, option: str = "--budget") -> int:
    """'80GiB' / '80GB' / '1.5TiB' / '123' -> bytes (`option` names the flag in the error). Binary units for
    `KiB`..`TiB` and bare `K`..`T`, decimal for `KB`..`TB`.

    Raises:
      ValueError: unparseable size.
    """
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{option} {text!r}: expected a size like 80GiB, 80GB or 85899345920")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    powers = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}
    base = 1024 if "I" in unit or unit in ("K", "M", "G", "T") else 1000
    return int(value * base ** powers[unit[0]])
