"""scripts/retarget_imports.py: code written against the old flat ``msquant`` namespace is
moved to the two facades (and the modules of the names that left the public API), and the
result imports."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import msquant
import msquant.plugin

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import retarget_imports  # noqa: E402

OLD = """import msquant
from msquant import Processor, quantize, REPORT_FILE  # noqa: F401
from msquant import expert_fallback as fallback, load_config


def f(report):
    from msquant import Saver, ConfigError

    registry = msquant.default_registry()
    msquant.quantize("m", "o", "c.yaml", registry=registry)
    return msquant.strip_timings(report), msquant.expert_fallback(1, 2)
"""

NEW = """import msquant
from msquant.plugin.model import enough_expert_tokens
from msquant.report.document import strip_timings
from msquant.plugin import Processor  # noqa: F401
from msquant import quantize  # noqa: F401
from msquant.report.run_report import REPORT_FILE  # noqa: F401
from msquant.plugin.model import enough_expert_tokens as fallback
from msquant import load_config


def f(report):
    from msquant.plugin import Saver
    from msquant import ConfigError

    registry = msquant.plugin.default_registry()
    msquant.quantize("m", "o", "c.yaml", registry=registry)
    return strip_timings(report), enough_expert_tokens(1, 2)
"""


def test_old_imports_and_attributes_are_retargeted() -> None:
    assert retarget_imports.rewrite(OLD) == NEW
    assert retarget_imports.rewrite(NEW) == NEW  # already right: left alone


def test_a_plugin_name_that_moved_to_a_namespace_is_retargeted() -> None:
    """Issue 26 thinned ``msquant.plugin``: a moved name goes to its sub-namespace."""
    old = "from msquant.plugin import Saver, qrange  # noqa: F401\n"
    assert retarget_imports.rewrite(old) == (
        "from msquant.plugin import Saver  # noqa: F401\n"
        "from msquant.plugin.numerics import qrange  # noqa: F401\n"
    )


def test_the_rewritten_code_imports(tmp_path: Path) -> None:
    module = tmp_path / "retargeted_sample.py"
    module.write_text(NEW, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        sample = importlib.import_module("retargeted_sample")
    finally:
        sys.path.remove(str(tmp_path))
    assert sample.Processor is msquant.plugin.Processor
    assert sample.fallback(4, 2) is True


@pytest.mark.parametrize("name", sorted(retarget_imports.MOVED_OUT))
def test_every_name_that_left_the_api_is_where_the_script_says(name: str) -> None:
    assert name not in msquant.__all__ and name not in msquant.plugin.__all__
    assert hasattr(importlib.import_module(retarget_imports.MOVED_OUT[name]), name)


def test_a_missing_path_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert retarget_imports.main([str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in caplog.text
    target = tmp_path / "code.py"
    target.write_text("from msquant import Saver\n", encoding="utf-8")
    assert retarget_imports.main([str(tmp_path)]) == 0
    assert target.read_text(encoding="utf-8") == "from msquant.plugin import Saver\n"
