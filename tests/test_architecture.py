"""The package's architecture, checked on the source: no import cycle, and the layers import only
downwards (docs/developer/architecture.md draws the same graph)."""

from __future__ import annotations

import inspect
from pathlib import Path

from import_graph import cycles, import_graph, package_graph

REPO = Path(__file__).resolve().parents[1]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_msquant_has_no_import_cycle() -> None:
    """No module of msquant (built-in processors included) imports itself back through others,
    counting imports inside functions and the package ``__init__`` each import runs on the way;
    ``if TYPE_CHECKING:`` imports never run and do not count."""
    assert cycles(import_graph(REPO)) == []


def test_the_graph_counts_the_package_inits_an_import_runs(tmp_path: Path) -> None:
    """The checker itself: ``from msquant.facade.low import X`` runs ``msquant/facade/__init__``
    first, so a facade package whose ``__init__`` re-exports a module that imports one of the
    facade's own submodules closes a cycle (the shape issue 26 found: ``msquant.plugin``
    re-exporting planning, which imported ``msquant.plugin.processor``). The packages above the
    importing module itself were already running and are no edge, so the root package, which
    re-exports everything, closes no cycle; neither does a package importing its own modules."""
    repo = _write(
        tmp_path,
        {
            "msquant/__init__.py": "from msquant.planning import build\n",
            "msquant/planning/__init__.py": "from msquant.planning.build import plan\n",
            "msquant/planning/build.py": "from msquant.facade.low import X\ndef plan(): ...\n",
            "msquant/facade/__init__.py": "from msquant.facade.low import X\nfrom msquant.planning import plan\n",
            "msquant/facade/low.py": "X = 1\n",
            "processors/__init__.py": "",
        },
    )
    graph = import_graph(repo)
    assert graph["msquant.planning.build"] == {"msquant.facade", "msquant.facade.low"}
    assert graph["msquant.facade"] == {"msquant.facade.low", "msquant.planning"}
    assert graph["msquant.planning"] == {"msquant.planning.build"}
    assert graph["msquant"] == {"msquant.planning", "msquant.planning.build"}
    assert cycles(graph) == [["msquant.facade", "msquant.planning", "msquant.planning.build"]]
    # the fix: the low module moves out of the facade's package; nothing closes a cycle then
    (repo / "msquant" / "facade" / "low.py").rename(repo / "msquant" / "low.py")
    for name in ("msquant/facade/__init__.py", "msquant/planning/build.py"):
        path = repo / name
        path.write_text(path.read_text().replace("msquant.facade.low", "msquant.low"))
    assert cycles(import_graph(repo)) == []


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
    assert graph["msquant.a"] == {"msquant.pkg.b", "msquant.pkg"}  # pkg's __init__ runs first
    assert graph["msquant.pkg.b"] == {"msquant.a"}
    assert graph["msquant.c"] == {"msquant.version"}
    assert graph["msquant.d"] == {"msquant.c"}
    assert graph["msquant.processors.p"] == {"msquant.a"}
    assert cycles(graph) == [["msquant.a", "msquant.pkg.b"]]


def _imports_of(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """``module -> imported msquant modules`` for the modules of ``package``."""
    return {m: t for m, t in graph.items() if m == package or m.startswith(package + ".")}


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


#: What architecture knowledge and pure numerics must never depend on: the run mechanics, the
#: run report, the plugin contracts and the plugin facade.
UPPER_LAYERS = ("msquant.run", "msquant.report", "msquant.plugin", "msquant.contracts")


def test_model_and_quant_import_nothing_from_run_report_or_plugin() -> None:
    graph = import_graph(REPO)
    for package in ("msquant.model", "msquant.quant"):
        modules = _imports_of(graph, package)
        assert modules, f"{package} has no modules: the layout changed, update this test"
        offending = {
            module: sorted(t for t in targets if _in(t, UPPER_LAYERS))
            for module, targets in modules.items()
        }
        assert {m: t for m, t in offending.items() if t} == {}, package


def test_the_packages_import_each_other_without_a_cycle() -> None:
    """Folded to msquant's first-level packages (``run``, ``plugin``, ``model``, ...), the imports
    still form no cycle: each package only uses those drawn below it in
    docs/developer/architecture.md."""
    assert cycles(package_graph(import_graph(REPO))) == []


def test_the_layer_rule_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a function-level import of ``msquant.run`` inside ``msquant.model``
    is an upward import, and a package cycle appears in the folded graph."""
    repo = _write(
        tmp_path,
        {
            "msquant/__init__.py": "",
            "msquant/model/__init__.py": "",
            "msquant/model/layers.py": "def f():\n    from msquant.run.runner import go\n",
            "msquant/run/__init__.py": "",
            "msquant/run/runner.py": "from msquant.model.layers import f\ndef go():\n    f()\n",
            "processors/__init__.py": "",
        },
    )
    graph = import_graph(repo)
    assert _in("msquant.run.runner", UPPER_LAYERS)
    assert graph["msquant.model.layers"] == {"msquant.run", "msquant.run.runner"}
    assert cycles(package_graph(graph)) == [["msquant.model", "msquant.run"]]


def test_no_public_name_hides_a_subpackage() -> None:
    """``msquant.X`` must stay the subpackage or module ``X`` for every one of msquant's own:
    a public name of the same spelling (a function ``msquant.plan``, say) would replace the
    package attribute, and ``import msquant.X.y`` followed by ``msquant.X.y`` would break."""
    import msquant

    children = {module.split(".")[1] for module in import_graph(REPO) if module.count(".") >= 1}
    assert sorted(children & set(msquant.__all__)) == []
    for child in children:
        assert getattr(msquant, child, None) is None or inspect.ismodule(getattr(msquant, child))
