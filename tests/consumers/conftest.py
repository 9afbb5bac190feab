"""Fixtures of the consumer suite: the exports (made once per session) and the engines' code, one
release at a time (each engine check runs against every release the suite supports)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# appended, not prepended: tests/conftest.py must stay the `conftest` the other tests import
sys.path.append(str(Path(__file__).parent))

import ascend_engine  # noqa: E402
import vllm_engine  # noqa: E402
from exports import ExportFactory  # noqa: E402
from wheels import Release  # noqa: E402


@pytest.fixture(scope="session")
def make_export(tmp_path_factory: pytest.TempPathFactory) -> ExportFactory:
    """Builds consumer models and msquant exports on demand, each once per session."""
    return ExportFactory(tmp_path_factory.mktemp("consumer_exports"))


def _release_id(release: Release) -> str:
    return f"{release.project}-{release.version}"


# session-scoped parameters: pytest orders the tests so that each release is imported once
@pytest.fixture(scope="session", params=vllm_engine.RELEASES, ids=_release_id)
def vllm_release(request: pytest.FixtureRequest) -> Release:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session", params=ascend_engine.RELEASES, ids=_release_id)
def ascend_release(request: pytest.FixtureRequest) -> Release:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def vllm(vllm_release: Release) -> Release:
    """The test runs against ``vllm_release`` (imported if another one was)."""
    vllm_engine.use_vllm(vllm_release)
    return vllm_release


@pytest.fixture
def vllm_ascend(ascend_release: Release) -> Release:
    """The test runs against ``ascend_release`` of vLLM-Ascend (over its vLLM)."""
    ascend_engine.use_ascend(ascend_release)
    return ascend_release
