"""Units that fit the numbers they show, for the CLI's tables and plots (no torch)."""

from __future__ import annotations

from typing import Iterable, Optional

#: Binary byte units, smallest first.
BYTE_UNITS: tuple[tuple[str, int], ...] = (("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20),
                                           ("GiB", 1 << 30), ("TiB", 1 << 40))


def byte_unit(values: Iterable[float]) -> tuple[str, int]:
    """``(name, bytes)`` of the largest unit in which the smallest non-zero value of a column
    is still at least 1 (so that no row of it reads 0.0); B when every value is 0."""
    smallest = min((v for v in values if v > 0), default=0)
    fitting = [unit for unit in BYTE_UNITS if smallest >= unit[1]]
    return fitting[-1] if fitting else BYTE_UNITS[0]


def in_unit(nbytes: float, unit: tuple[str, int]) -> str:
    """``nbytes`` in ``unit`` (``byte_unit``), thousands separated: whole bytes, one
    decimal otherwise."""
    return f"{nbytes / unit[1]:,.1f}" if unit[1] > 1 else f"{nbytes:,.0f}"


def format_duration_us(us: Optional[float]) -> str:
    """A duration given in us, with the unit that fits it: ``812.3 us``, ``1.52 ms``,
    ``2.31 s`` (``-`` for none)."""
    if us is None:
        return "-"
    if us < 1e3:
        return f"{us:.1f} us"
    if us < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.2f} s"
