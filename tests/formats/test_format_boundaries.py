"""The format extension point's boundaries, checked on the source (AST, like the device boundary):
the engine names no built-in saver or format, and a format's reader never imports a packer (so an
exporter bug cannot hide behind the same bug in the reader that checks it)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: The built-in savers' and formats' type names the engine (``msquant/``) must never spell.
BUILTIN_NAMES = ("ascendv1_saver", "gptq_saver", "compressed_tensors", "mindie_format_saver")
#: The engine's packing helpers, which a reader must not use either.
PACKING_NAMES = ("pack_int32", "pack_int4_pairs", "packed_length")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements."""
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found.add(id(node.value))
    return found


def _code_words(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every string constant (docstrings aside), name, attribute and imported name in code."""
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.alias):
            yield node.lineno, f"{node.name} {node.asname or ''}"
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.module or ""
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            yield node.lineno, node.name


def builtin_names_in(root: Path) -> list[str]:
    """``path:line: word`` for every code word under ``root`` naming a built-in saver/format."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, word in _code_words(tree):
            if any(name in word for name in BUILTIN_NAMES):
                found.append(f"{path.relative_to(root.parent)}:{line}: {word!r}")
    return found


def test_the_engine_names_no_builtin_saver_or_format() -> None:
    assert builtin_names_in(REPO / "msquant") == []


def test_the_name_check_sees_code_but_not_docstrings(tmp_path: Path) -> None:
    package = tmp_path / "msquant"
    package.mkdir()
    (package / "ok.py").write_text(
        '"""Writes like ``gptq_saver`` are fine in a docstring."""\n'
        "# a comment naming ascendv1_saver is fine\n"
        "def f():\n    '''compressed_tensors too'''\n    return 1\n"
    )
    (package / "bad.py").write_text(
        "DEFAULT = 'ascendv1_saver'\nfrom x.compressed_tensors_saver import Saver\n"
        "def pick(gptq_saver): return f'{gptq_saver} mindie_format_saver'\n"
    )
    found = builtin_names_in(package)
    assert all(entry.startswith("msquant/bad.py") for entry in found), found
    assert {entry.split(":")[1] for entry in found} == {"1", "2", "3"}


# --- readers never import packers ----------------------------------------------------------


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import of a file, function-level ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _module_path(package_root: Path, module: str) -> Path | None:
    """The file of ``msquant.processors.X.Y`` under the ``processors/`` folder, if it is one."""
    prefix = "msquant.processors."
    if not module.startswith(prefix):
        return None
    base = package_root.joinpath(*module[len(prefix) :].split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _packs(leaf: str) -> bool:
    """A module that packs or saves: ``packer``, a format's ``saver`` (``mindie_saver``), or an
    old-style ``*_saver`` module."""
    return leaf in ("packer", "saver") or leaf.endswith("_saver")


def packer_imports(package_root: Path, start: Path) -> list[str]:
    """What ``start`` reaches, through the built-ins' own modules, that packs: a ``packer``
    module, a saver module, or one of the engine's packing helpers."""
    problems: list[str] = []
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        where = path.relative_to(package_root.parent)
        for module, names in _imports(path):
            leaf = module.rpartition(".")[2]
            if _packs(leaf) or module == "msquant.export.packing":
                problems.append(f"{where} imports {module}")
            problems += [f"{where} imports {name}" for name in names if name in PACKING_NAMES]
            problems += [f"{where} imports {module}.{name}" for name in names if _packs(name)]
            for candidate in [module] + [f"{module}.{name}" for name in names]:
                target = _module_path(package_root, candidate)
                if target is not None:
                    todo.append(target)
    return problems


def _readers(package_root: Path) -> list[Path]:
    """Each format's reading side: ``reader.py``, ``detect.py`` and the registry entry
    ``format.py`` (what ``verify`` and ``eval`` load)."""
    return sorted(
        path
        for name in ("reader.py", "detect.py", "format.py")
        for path in (package_root / "formats").glob(f"*/{name}")
    )


def test_readers_never_import_packers() -> None:
    package_root = REPO / "processors"
    readers = _readers(package_root)
    assert len([p for p in readers if p.name == "reader.py"]) >= 3, readers
    problems = [problem for path in readers for problem in packer_imports(package_root, path)]
    assert problems == []


def test_the_packer_check_follows_imports(tmp_path: Path) -> None:
    """The checker itself: a reader reaching a packer through a helper module, or importing a
    packing helper from msquant, is caught; a clean reader is not."""
    root = tmp_path / "processors"
    for name, text in {
        "formats/toy/reader.py": "from msquant.processors.formats.toy import helpers\n",
        "formats/toy/helpers.py": "def f():\n    from msquant.processors.formats.toy.packer import p\n",
        "formats/toy/packer.py": "p = 1\n",
        "formats/toy/format.py": "from msquant.processors.formats.toy import saver\n",
        "formats/other/reader.py": "from msquant import pack_int32, read_json\n",
        "formats/clean/reader.py": "from msquant import read_json\nimport torch\n",
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert packer_imports(root, root / "formats/toy/reader.py") == [
        "processors/formats/toy/helpers.py imports msquant.processors.formats.toy.packer"
    ]
    assert packer_imports(root, root / "formats/toy/format.py") == [
        "processors/formats/toy/format.py imports msquant.processors.formats.toy.saver"
    ]
    assert packer_imports(root, root / "formats/other/reader.py") == [
        "processors/formats/other/reader.py imports pack_int32"
    ]
    assert packer_imports(root, root / "formats/clean/reader.py") == []
