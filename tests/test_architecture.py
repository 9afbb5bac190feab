"""The package's architecture, checked on the source: no import cycle, and the layers import only
downwards (docs/developer/architecture.md draws the same graph)."""

from __future__ import annotations

from pathlib import Path

from import_graph import cycles, import_graph

REPO = Path(__file__).resolve().parents[1]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_msquant_has_no_import_cycle() -> None:
    """No module of msquant (built-in processors included) imports itself back through others,
    counting imports inside functions; ``if TYPE_CHECKING:`` imports never run and do not count."""
    assert cycles(import_graph(REPO)) == []


def test_the_graph_counts_function_level_imports_and_skips_type_checking(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by an import inside a function is found, one closed only
    under ``if TYPE_CHECKING:`` is not, and ``from package import module`` names the module."""
    repo = _write(
        tmp_path,
        {
            "msquant/__init__.py": "",
            "msquant/version.py": "__version__ = '0'\n",
            "msquant/a.py": "from msquant.pkg import b\n",
            "msquant/pkg/__init__.py": "",
            "msquant/pkg/b.py": "def f():\n    from msquant import a\n",
            "msquant/c.py": (
                "from typing import TYPE_CHECKING\nfrom msquant.version import __version__\n"
                "if TYPE_CHECKING:\n    from msquant import d\n"
            ),
            "msquant/d.py": "from .c import __version__\n",
            "processors/__init__.py": "",
            "processors/p.py": "from msquant import a\n",
        },
    )
    graph = import_graph(repo)
    assert graph["msquant.a"] == {"msquant.pkg.b"}
    assert graph["msquant.pkg.b"] == {"msquant.a"}
    assert graph["msquant.c"] == {"msquant.version"}
    assert graph["msquant.d"] == {"msquant.c"}
    assert graph["msquant.processors.p"] == {"msquant.a"}
    assert cycles(graph) == [["msquant.a", "msquant.pkg.b"]]
