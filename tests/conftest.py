"""Shared fixtures: tiny local models (built once per session) and a CLI runner."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import build_tiny_model  # noqa: E402

from msquant.cli import main  # noqa: E402

# The tiny models' matmuls are far too small to gain from threads; on a busy 2-core CI machine
# two threads per op mostly wait on each other (measured: 10 us -> 15 ms for a 64x64 linear).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]

#: The default selection of ``addopts`` (pyproject.toml): the tests that run on every commit.
DEFAULT_MARK_EXPRESSION = (
    "not slow and not consumers and not gptqmodel and not faults and not msmodelslim "
    "and not practices"
)
#: Most worker processes the default suite spreads over (each builds its own tiny models).
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (addopts): one worker per CPU for the default suite, whose tests are
    single-threaded (above) and independent; the opt-in suites (``-m slow``, ``consumers``,
    ``msmodelslim``...) run in one process, since they share download caches and run external
    tools that take the machine's cores themselves."""
    if config.option.markexpr != DEFAULT_MARK_EXPRESSION:
        return 0
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


# The MoE tests are written for transformers 5.24's fused experts. msquant also runs MoE models
# under 5.17 and 4.5x (checked by hand: those tests pass there but for transformers' own eager
# loop in 5.17 and the fused-layout assumptions under 4.x, where experts are already split).
NEEDS_MOE_TRANSFORMERS = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason=f"MoE support is tested with transformers >= 5.24, not {transformers.__version__}",
)
EXAMPLES = REPO / "yaml_examples"
CALIB_TXT = Path(__file__).parent / "data" / "calib.txt"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (hidden 64, intermediate 128) with a trained tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Llama stored in bfloat16 (msModelSlim crashes on such weights)."""
    import torch

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny_llama_bf16"), "llama", dtype=torch.bfloat16
    )


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (and cache per argument set) tiny models of other architectures."""
    cache: dict[tuple[object, ...], Path] = {}

    def build(arch: str = "llama", **kwargs: object) -> Path:
        key = (arch, *sorted(kwargs.items()))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch, **kwargs)  # type: ignore[arg-type]
        return cache[key]

    return build


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run ``msquant`` in-process with the given arguments; returns exit code, stdout and stderr."""

    def run(*args: str | Path) -> CliResult:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
