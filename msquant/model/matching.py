"""``include`` / ``exclude`` module selection with fnmatch-style globs (exclude wins).

Patterns are msModelSlim's: shell globs (``*``, ``?``, ``[...]``) matched case-sensitively on the
full module name, with brace expansion, as msModelSlim matches them with ``wcmatch``'s ``BRACE``
flag: ``model.layers.{0,1}.mlp.down_proj`` stands for two patterns and ``model.layers.{0..3}.*``
for four. Without the expansion such a pattern would be a literal that matches nothing, and the
layers it names would be quantized where msModelSlim keeps them float. The expansion is done by
``bracex``, the library ``wcmatch`` uses, with a cap on how many patterns one brace pattern may
stand for (:data:`MAX_EXPANSIONS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase
from functools import lru_cache

import bracex

__all__ = [
    "MAX_EXPANSIONS",
    "expand_braces",
    "first_matching_pattern",
    "glob_matches",
    "is_selected",
    "pattern_problem",
    "unmatched_patterns",
]

#: Most patterns one brace pattern may expand to (``{0..999}`` is 1000); more is refused.
MAX_EXPANSIONS = 10_000


@lru_cache(maxsize=4096)
def _expanded(pattern: str) -> tuple[str, ...]:
    if "{" not in pattern:
        return (pattern,)
    return tuple(bracex.expand(pattern, keep_escapes=False, limit=MAX_EXPANSIONS))


def expand_braces(pattern: str) -> list[str]:
    """The globs a brace pattern stands for (``a.{0,1}.b`` -> ``a.0.b``, ``a.1.b``; ``{0..2}`` is a
    range); a pattern without braces is returned alone.

    :raises ValueError: when the pattern stands for more than :data:`MAX_EXPANSIONS` globs.
    """
    problem = pattern_problem(pattern)
    if problem is not None:
        raise ValueError(problem)
    return list(_expanded(pattern))


def pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot be used (it expands to too many globs), or None."""
    try:
        _expanded(pattern)
    except bracex.ExpansionLimitException:
        return (
            f"pattern {pattern!r} expands to more than {MAX_EXPANSIONS} globs; write a shorter "
            "range or a wildcard (model.layers.*.mlp)"
        )
    return None


def glob_matches(name: str, pattern: str) -> bool:
    """True when ``name`` matches the glob ``pattern`` (case-sensitive, braces expanded).

    A pattern that expands to too many globs matches nothing (validation reports it first).
    """
    if pattern_problem(pattern) is not None:
        return False
    return any(fnmatchcase(name, glob) for glob in _expanded(pattern))


def first_matching_pattern(name: str, patterns: Sequence[str]) -> str | None:
    """The first pattern of ``patterns`` matching ``name``, or None."""
    return next((pattern for pattern in patterns if glob_matches(name, pattern)), None)


def is_selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """True when ``name`` matches an include glob and no exclude glob (case-sensitive)."""
    if first_matching_pattern(name, exclude) is not None:
        return False
    return first_matching_pattern(name, include) is not None


def unmatched_patterns(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The patterns that match none of ``names`` (typos users should hear about)."""
    names = list(names)
    return [p for p in patterns if not any(glob_matches(n, p) for n in names)]
