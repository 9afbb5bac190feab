"""Move code written against the old flat ``msquant`` namespace to the API split by audience.

Until issue 15's API split, ``msquant`` exported about 200 names; now ``msquant`` holds what
users need and ``msquant.plugin`` (with its sub-namespaces, issue 26) what plugin authors need
(docs/api.md), and 17 names left
the public API for the module they are defined in. This rewrites, in the given files or
folders, every ``from msquant import ...`` and every ``msquant.NAME`` to where ``NAME`` lives
now; run ``ruff check --fix`` and ``ruff format`` afterwards to sort and wrap the imports::

    python scripts/retarget_imports.py processors tests bench
"""

from __future__ import annotations

import argparse
import ast
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import msquant
import msquant.plugin
import msquant.plugin.checks
import msquant.plugin.devices
import msquant.plugin.export
import msquant.plugin.model
import msquant.plugin.numerics
import msquant.plugin.planning
import msquant.plugin.reading

logger = logging.getLogger("retarget_imports")

#: The names that were public before the split and are in neither list now: where they live.
MOVED_OUT = {
    "ConfigLike": "msquant.config.resolve",
    "build_config_model": "msquant.config",
    "validation_message": "msquant.errors",
    "render_plan": "msquant.planning.render",
    "REPORT_FILE": "msquant.report.run_report",
    "write_report": "msquant.report.run_report",
    "LayerTiming": "msquant.report.run_report",
    "EvaluationReport": "msquant.report.run_report",
    "render_report": "msquant.report.table",
    "strip_timings": "msquant.report.document",
    "report_from_dict": "msquant.report.document",
    "config_sha256": "msquant.report.hashes",
    "calibration_sha256": "msquant.report.hashes",
    "render_html": "msquant.report.html.page",
    "write_html": "msquant.report.html.page",
    "check_ppl_baseline": "msquant.report.regression",
    "parse_tolerance": "msquant.report.regression",
}
#: The plugin API's sub-namespaces (issue 26): the names ``msquant.plugin`` held before and moved.
PLUGIN_NAMESPACES = (
    msquant.plugin.numerics,
    msquant.plugin.model,
    msquant.plugin.planning,
    msquant.plugin.export,
    msquant.plugin.reading,
    msquant.plugin.checks,
    msquant.plugin.devices,
)
#: The names that changed (the old one is written as the new one, from its new home).
RENAMED = {"expert_fallback": "enough_expert_tokens"}


def home(name: str) -> str | None:
    """The module ``name`` is imported from now; None for a name msquant never exported."""
    name = RENAMED.get(name, name)
    if name in msquant.__all__:
        return "msquant"
    if name in msquant.plugin.__all__:
        return "msquant.plugin"
    for namespace in PLUGIN_NAMESPACES:
        if name in namespace.__all__:
            return namespace.__name__
    return MOVED_OUT.get(name)


def rewrite(source: str) -> str:
    """``source`` with its msquant imports and ``msquant.NAME`` uses retargeted."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, int, str]] = []  # (line, col, end line, end col, text)
    added: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module in ("msquant", "msquant.plugin")
            and node.level == 0
        ):
            last = lines[(node.end_lineno or node.lineno) - 1]
            comment = last[node.end_col_offset :].strip()  # a trailing comment (noqa) is kept
            text = _split_import(node, comment)
            if text is not None:
                edits.append((node.lineno, 0, node.end_lineno or node.lineno, len(last), text))
        elif _is_msquant_attribute(node):
            assert isinstance(node, ast.Attribute)
            target = home(node.attr)
            new_name = RENAMED.get(node.attr, node.attr)
            if target is None or (target == "msquant" and new_name == node.attr):
                continue
            if target == "msquant":
                replacement = f"msquant.{new_name}"
            elif target == "msquant.plugin":
                replacement = f"msquant.plugin.{new_name}"
            else:
                replacement = new_name
                added.setdefault(target, set()).add(new_name)
            edits.append(
                (node.lineno, node.col_offset, node.lineno, node.end_col_offset or 0, replacement)
            )
    for line, col, end_line, end_col, text in sorted(edits, reverse=True):
        head, tail = lines[line - 1][:col], lines[end_line - 1][end_col:]
        lines[line - 1 : end_line] = [head + text + tail]
    return _add_imports("".join(lines), added)


def _is_msquant_attribute(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "msquant"
        and node.lineno == node.end_lineno
    )


def _split_import(node: ast.ImportFrom, comment: str) -> str | None:
    """The statements replacing one ``from msquant import ...`` (one per target module, each
    followed by ``comment``), or None when it is already right."""
    groups: dict[str, list[str]] = {}
    for alias in node.names:
        target = home(alias.name) or node.module or "msquant"  # an unknown name is left as is
        name = RENAMED.get(alias.name, alias.name)
        spelled = name if alias.asname in (None, name) else f"{name} as {alias.asname}"
        groups.setdefault(target, []).append(spelled)
    unchanged = [RENAMED.get(a.name, a.name) for a in node.names] == [a.name for a in node.names]
    if list(groups) == [node.module] and unchanged:
        return None
    indent = " " * node.col_offset
    suffix = f"  {comment}" if comment else ""
    statements = [
        f"from {module} import {', '.join(names)}{suffix}" for module, names in groups.items()
    ]
    return "".join(f"{indent}{statement}\n" for statement in statements)


def _add_imports(source: str, added: dict[str, set[str]]) -> str:
    """``source`` with ``from MODULE import NAMES`` after its first ``import msquant``."""
    if not added:
        return source
    lines = source.splitlines(keepends=True)
    at = next(
        (i for i, line in enumerate(lines) if line.strip().startswith("import msquant")), None
    )
    if at is None:
        return source
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    new = [f"{indent}from {m} import {', '.join(sorted(n))}\n" for m, n in sorted(added.items())]
    return "".join(lines[: at + 1] + new + lines[at + 1 :])


def python_files(paths: Iterable[Path]) -> Iterator[Path]:
    """The ``.py`` files given, and those under the folders given."""
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*.py") if ".venv" not in p.parts)
        elif path.suffix == ".py":
            yield path


def main(argv: list[str] | None = None) -> int:
    """Rewrite the files in place; exit 0, or 2 for a path that does not exist."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="files or folders to rewrite")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        logger.error("no such file or folder: %s", ", ".join(missing))
        return 2
    for path in python_files(args.paths):
        source = path.read_text(encoding="utf-8")
        new = rewrite(source)
        if new != source:
            path.write_text(new, encoding="utf-8")
            logger.info("rewrote %s", path)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main())
