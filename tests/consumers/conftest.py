"""Fixtures of the consumer suite: the exports (made once per session) and the engines' code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# appended, not prepended: tests/conftest.py must stay the `conftest` the other tests import
sys.path.append(str(Path(__file__).parent))

from exports import ExportFactory  # noqa: E402


@pytest.fixture(scope="session")
def make_export(tmp_path_factory: pytest.TempPathFactory) -> ExportFactory:
    """Builds consumer models and msquant exports on demand, each once per session."""
    return ExportFactory(tmp_path_factory.mktemp("consumer_exports"))
