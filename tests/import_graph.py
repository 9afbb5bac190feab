"""The import graph of msquant's own modules, read from the source with :mod:`ast` (nothing is imported).

A test helper for ``test_architecture.py``: which of msquant's modules each module imports, at
module level or inside a function, with ``if TYPE_CHECKING:`` blocks left out (they never run).
The built-in processors (``processors/``) are part of the graph under their installed name,
``msquant.processors``.

An edge goes to the module a statement names: ``from msquant.run import steps`` names the
module ``msquant.run.steps`` when that is a module, ``from msquant.run import quantize`` names
the package ``msquant.run``. Python also runs the ``__init__`` of every package above an imported
module first, and those are edges too (issue 26: a cycle through a package ``__init__`` is a
cycle at run time), except the packages above the importing module itself, which were already
running before it could: so the root package, which re-exports the public API and sits above
every module, closes no cycle, and neither does a package importing its own modules.
:func:`package_graph` is the same check at the scale of msquant's first-level parts.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

__all__ = [
    "FACADES",
    "ROOT_PACKAGE",
    "cycles",
    "import_graph",
    "is_facade",
    "module_files",
    "package_graph",
    "subpackage",
]

ROOT_PACKAGE = "msquant"
#: The two public facades: the user API (the root package) and the plugin-author API. Each
#: re-exports names from every part of the engine, and no engine module imports either.
FACADES = (ROOT_PACKAGE, f"{ROOT_PACKAGE}.plugin")


def is_facade(module: str) -> bool:
    """``msquant``, ``msquant.plugin`` or one of the plugin API's sub-namespaces."""
    return module in FACADES or module.startswith(f"{ROOT_PACKAGE}.plugin.")


def module_files(repo: Path) -> dict[str, Path]:
    """Every module of the engine and of the built-in processors, by dotted name."""
    sources = {ROOT_PACKAGE: repo / "msquant", f"{ROOT_PACKAGE}.processors": repo / "processors"}
    modules: dict[str, Path] = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level, in functions and classes, but not
    in the body of ``if TYPE_CHECKING:`` (its ``else`` branch runs, so it is kept)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _package_of(module: str, path: Path) -> str:
    """The package a relative import in ``module`` starts from."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """``name`` or its longest prefix that is one of ``modules``; None outside msquant."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, path: Path, modules: Mapping[str, Path]
) -> Iterable[str]:
    """The msquant modules one import statement names."""
    if isinstance(node, ast.Import):
        return [t for alias in node.names if (t := _known(alias.name, modules))]
    base = node.module or ""
    if node.level:
        package = _package_of(module, path)
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    found = []
    for alias in node.names:
        target = _known(f"{base}.{alias.name}", modules) if alias.name != "*" else None
        if target != f"{base}.{alias.name}":  # a name defined in the module, not a submodule
            target = _known(base, modules)
        if target:
            found.append(target)
    return found


def _packages_run(target: str, module: str, modules: Mapping[str, Path]) -> set[str]:
    """The packages whose ``__init__`` Python runs when ``module`` imports ``target``: every
    package above ``target`` (and ``target`` itself), less those above ``module``, which were
    already running before ``module`` could (so the root package, above everything, never is)."""
    own = set(_ancestors(module))
    return {p for p in (target, *_ancestors(target)) if p in modules and p not in own}


def _ancestors(module: str) -> list[str]:
    """``a.b.c`` -> ``["a.b", "a"]``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def import_graph(repo: Path) -> dict[str, set[str]]:
    """``module -> the msquant modules it imports`` for every module (self-imports dropped),
    each import counting the ``__init__`` of every package Python runs on the way
    (:func:`_packages_run`): ``from msquant.contracts.processor import X`` in ``msquant.run.steps``
    is an edge to ``msquant.contracts.processor`` and one to ``msquant.plugin``."""
    modules = module_files(repo)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        named = {t for node in _import_nodes(tree) for t in _targets(node, module, path, modules)}
        targets = {p for t in named for p in _packages_run(t, module, modules)}
        graph[module] = targets - {module}
    return graph


def subpackage(module: str) -> str:
    """The first-level part of msquant a module belongs to: ``msquant.run.steps`` ->
    ``msquant.run``; a module directly under the root (``msquant.errors``) is its own part."""
    parts = module.split(".")
    return ".".join(parts[:2])


def package_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The import graph folded to first-level parts (:func:`subpackage`), without self-edges.

    The facades (:func:`is_facade`: ``msquant`` for users, ``msquant.plugin`` and its
    sub-namespaces for plugin authors) are left out as sources: they re-export every part and
    sit above everything by design (the contracts they re-export live in ``msquant.contracts``,
    which is counted).
    """
    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = subpackage(module)
        if is_facade(module):
            continue
        folded.setdefault(source, set()).update(
            subpackage(t) for t in targets if subpackage(t) != source
        )
    return folded


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (each an import cycle), each
    sorted, in sorted order (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)
