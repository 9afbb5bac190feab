"""Text of the report page: escaping, numbers as shown, and axis tops."""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from typing import Any

__all__ = ["finite_number", "esc", "fmt", "seconds_text", "mean", "nice_max"]


def finite_number(value: Any) -> float | None:
    """A finite int or float as a float (bools and anything else: None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def esc(value: Any) -> str:
    """HTML-escaped text of any value (quotes too: safe in attributes)."""
    return html.escape(str(value), quote=True)


def fmt(value: Any, digits: int = 4) -> str:
    """A value as the page shows it: numbers to ``digits`` significant digits, missing as ``-``."""
    number = finite_number(value)
    if number is None:
        return "-" if value is None or isinstance(value, float) else str(value)
    if isinstance(value, int):
        return str(value)
    return f"{number:.{digits}g}"


def seconds_text(value: Any) -> str:
    """A duration in seconds, ``-`` when missing."""
    number = finite_number(value)
    return "-" if number is None else f"{number:.2f} s"


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the present values, None when there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def nice_max(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (axis top)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * power * (1 + 1e-12):
            return step * power
    return 10 * power
