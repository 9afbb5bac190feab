"""One name per type: no two classes of the engine and the built-ins share a name, so a name in a
message, a log line or the docs says which type it is (issue 15: two ``GPTQScheme`` classes, the
GPTQ writer's and the GPTQ reader's, once meant different things)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("msquant", "processors")


def class_definitions() -> dict[str, list[str]]:
    """Class name -> the modules defining it (every class statement, nested ones included)."""
    found: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    found[node.name].append(str(path.relative_to(REPO)))
    return found


def test_no_two_types_share_a_name() -> None:
    found = class_definitions()
    assert "GPTQScheme" in found and "Saver" in found  # the walk sees both packages
    shared = {name: where for name, where in found.items() if len(where) > 1}
    assert shared == {}
