"""``include`` / ``exclude`` module selection with fnmatch-style globs (exclude wins)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

__all__ = ["is_selected", "unmatched_patterns"]


def is_selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """True when ``name`` matches an include glob and no exclude glob (case-sensitive)."""
    if any(fnmatchcase(name, pattern) for pattern in exclude):
        return False
    return any(fnmatchcase(name, pattern) for pattern in include)


def unmatched_patterns(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The patterns that match none of ``names`` (typos users should hear about)."""
    names = list(names)
    return [p for p in patterns if not any(fnmatchcase(n, p) for n in names)]
