"""The tests mirror the package layout (issue 15 point 5): the tests of ``msquant/<part>/`` live in
``tests/<part>/``, those of the built-in processors in ``tests/processors/`` and
``tests/formats/``; the opt-in suites keep their folders; a test of the whole package sits at the
top. Tests use the public API (``msquant``, ``msquant.plugin``) and reach into engine modules
mostly where a test is about that part's internals; what remains is counted here so that it
only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import is_facade, module_files

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

#: Folders of opt-in suites and data, not mirroring a package.
OTHER_FOLDERS = {"consumers", "oracle", "reliability", "data", "__pycache__"}
#: Folders of the built-in processors' tests: their own modules are ``msquant.processors.*``.
PROCESSOR_FOLDERS = {"processors", "formats"}
#: Top-level tests about the whole package (or a module at the root of msquant).
TOP_LEVEL = {
    "test_architecture.py",
    "test_bench_smoke.py",
    "test_docs.py",
    "test_layout.py",
    "test_prepare_model.py",
    "test_public_api.py",
    "test_registry_base.py",
    "test_retarget_imports.py",
    "test_smollm2.py",
    "test_type_names.py",
}
#: Import statements in the mirrored tests that name an engine module of another part than the
#: test's own (most set up a model: ``msquant.load.model_folder``, ``msquant.load.calibration``).
#: Measured when the tests moved (69), then 87 after the smoothing, rotation, group and W8A8 tests
#: of the same session merged, 90 with the transform-check tests (the in-memory runner and the
#: model loaders), 115 with the flex_awq_ssz, VLM and streaming-cycle tests (the loaders, the
#: layer finder, the layer-wise runner), 120 with the routed-experts flex_awq_ssz tests (the same
#: four), 123 with the MX-scheme tests (issue 26: the eval loader, the plan renderer, the
#: checkpoint store), 124 with the image calibration test (the image loader), 125 with the FP8
#: scheme test (eval's model loader), 126 with the MX compressed-tensors test (eval's model
#: loader); lower it when a test moves to the public API.
CROSS_PART_IMPORTS = 126


def _parts() -> set[str]:
    """The first-level parts of the engine: ``run``, ``plugin``, ..., and root modules."""
    return {m.split(".")[1] for m in module_files(REPO) if m.count(".") >= 1} - {"processors"}


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if p.parent.name not in OTHER_FOLDERS)


def test_every_test_file_sits_in_the_folder_of_its_part() -> None:
    parts = _parts()
    misplaced = []
    for path in _test_files():
        folder = path.parent.relative_to(TESTS).parts
        if not folder:
            if path.name not in TOP_LEVEL:
                misplaced.append(str(path.relative_to(TESTS)))
        elif len(folder) > 1 or (folder[0] not in parts and folder[0] not in PROCESSOR_FOLDERS):
            misplaced.append(str(path.relative_to(TESTS)))
    assert misplaced == []
    assert not set(TOP_LEVEL) - {p.name for p in TESTS.glob("test_*.py")}


def test_engine_modules_of_other_parts_are_imported_no_more_than_counted() -> None:
    """``from msquant.<other part>.<module> import ...`` in a test of ``<part>`` is counted; the
    facades, the built-in processors' modules and the test's own part are not."""
    found = {str(p.relative_to(TESTS)): _cross_part_imports(p) for p in _test_files()}
    assert sum(found.values()) <= CROSS_PART_IMPORTS, {p: n for p, n in found.items() if n}


def test_the_count_sees_an_import_of_another_part(tmp_path: Path) -> None:
    """The counter itself, on a test of ``run``: facades, processors and ``msquant.run.*`` are
    free; ``msquant.load.*`` and a plugin submodule are counted."""
    path = tmp_path / "run" / "test_x.py"
    path.parent.mkdir()
    path.write_text(
        "import msquant\n"
        "from msquant.plugin import Saver\n"
        "from msquant.processors.linear_quant.config import LinearQuantConfig\n"
        "from msquant.run.runner import LayerRunner\n"
        "from msquant.load.calibration import read_calibration_texts\n"
        "from msquant.contracts.distributed import SINGLE\n",
        encoding="utf-8",
    )
    assert _cross_part_imports(path, tmp_path) == 2


def _cross_part_imports(path: Path, tests: Path = TESTS) -> int:
    """Import statements of ``path`` naming an engine module outside the test's own part."""
    folder = path.parent.relative_to(tests).parts
    own = folder[0] if folder else path.stem.removeprefix("test_")
    count = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            facade = is_facade(module)
            if parts[0] != "msquant" or facade or parts[1] == "processors":
                continue
            count += parts[1] != own
    return count
