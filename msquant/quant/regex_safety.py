"""Refuse ``dynamic`` rule patterns whose matching time can explode.

Python's :mod:`re` backtracks: ``(.*)*X`` takes longer than a minute on a 32-character module name
that lacks the ``X``, and every extra ``.*`` in a row multiplies the work by the name's length
(seven took 2 s per name here). A shared config with such a rule would hang ``plan`` and ``quant``.
GPTQModel and vLLM match these rules with ordinary regular expressions too, so rather than a
different engine, msquant refuses the two shapes that explode:

* a quantifier applied to a group that itself holds a quantifier or an alternation (nested
  quantifiers: ``(.*)*``, ``(a+)+``, ``(a|ab)*``), unless the inner part is possessive or atomic;
* more than :data:`MAX_UNBOUNDED` unbounded quantifiers (``*``, ``+``, ``{n,}``) in one pattern.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

# The parser the re module itself uses (renamed in Python 3.11), so the check sees the pattern re runs.
_NEW_NAMES = sys.version_info >= (3, 11)
_sre_parse: Any = importlib.import_module("re._parser" if _NEW_NAMES else "sre_parse")
_sre_constants: Any = importlib.import_module("re._constants" if _NEW_NAMES else "sre_constants")

__all__ = ["MAX_UNBOUNDED", "pattern_risk"]

#: Most unbounded quantifiers a rule pattern may hold (``.*layers\.1\..*(q|k)_proj.*`` has 3).
MAX_UNBOUNDED = 4

_REPEATS = {_sre_constants.MAX_REPEAT, _sre_constants.MIN_REPEAT}
_MAXREPEAT = _sre_constants.MAXREPEAT
_BRANCH = _sre_constants.BRANCH
_SUBPATTERN = _sre_constants.SUBPATTERN
# Atomic groups and possessive quantifiers (3.11+) never backtrack into their body.
_NO_BACKTRACK = {
    getattr(_sre_constants, name)
    for name in ("ATOMIC_GROUP", "POSSESSIVE_REPEAT")
    if hasattr(_sre_constants, name)
}


def _children(op: Any, arg: Any) -> list[Any]:
    """The sub-patterns of one parsed item."""
    if op in _REPEATS or op in _NO_BACKTRACK and isinstance(arg, tuple) and len(arg) == 3:
        return [arg[2]]
    if op == _SUBPATTERN:
        return [arg[-1]]
    if op == _BRANCH:
        return list(arg[1])
    if op in _NO_BACKTRACK:
        return [arg]
    return []


def _holds_backtracking(items: Any) -> bool:
    """Whether a parsed sub-pattern holds a repeat of more than one or an alternation (outside
    atomic and possessive parts)."""
    for op, arg in items:
        if op in _NO_BACKTRACK:
            continue
        if op in _REPEATS and arg[1] > 1:
            return True
        if op == _BRANCH:
            return True
        if any(_holds_backtracking(child) for child in _children(op, arg)):
            return True
    return False


def _scan(items: Any, found: dict[str, Any]) -> None:
    for op, arg in items:
        if op in _NO_BACKTRACK:
            continue
        if op in _REPEATS:
            low, high, body = arg
            if high == _MAXREPEAT:
                found["unbounded"] += 1
            if high > 1 and _holds_backtracking(body):
                found["nested"] = True
        for child in _children(op, arg):
            _scan(child, found)


def pattern_risk(pattern: str) -> str | None:
    """Why matching ``pattern`` may take exponential or very long time, or None.

    The pattern must compile (check that first).
    """
    parsed = _sre_parse.parse(pattern)
    found: dict[str, Any] = {"unbounded": 0, "nested": False}
    _scan(parsed, found)
    if found["nested"]:
        return (
            "it applies a quantifier to a group that holds another quantifier or an alternation "
            "(as in (.*)* or (a|b)+), which can take exponential time to match; write it without "
            "the nesting (e.g. .*X instead of (.*)*X)"
        )
    if found["unbounded"] > MAX_UNBOUNDED:
        return (
            f"it holds {found['unbounded']} unbounded quantifiers (*, +, {{n,}}); more than "
            f"{MAX_UNBOUNDED} can take very long to match: merge the runs of .* into one"
        )
    return None
