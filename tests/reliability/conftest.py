"""Fixtures of the red-team replays: a case folder holding a copy of the tiny model and the
configs, so that :func:`replay.tree` sees everything a run could touch."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).parent))  # after tests/: "conftest" stays the root one

from replay import CALIB_TXT, GPTQ_YAML, MINMAX_YAML  # noqa: E402


@pytest.fixture
def case(tmp_path: Path, tiny_llama: Path) -> Path:
    """A folder holding ``model/`` (a copy of the tiny Llama), ``w8.yaml`` (minmax) and
    ``gptq.yaml``; the runs write beside them."""
    root = tmp_path / "case"
    root.mkdir()
    shutil.copytree(tiny_llama, root / "model")
    (root / "w8.yaml").write_text(MINMAX_YAML, encoding="utf-8")
    (root / "gptq.yaml").write_text(GPTQ_YAML, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def exported(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """An uninterrupted export of the tiny model (per config text and options), made once."""
    import msquant

    cache: dict[tuple[str, bool], Path] = {}

    def build(config_text: str = MINMAX_YAML, calibrated: bool = False) -> Path:
        key = (config_text, calibrated)
        if key not in cache:
            root = tmp_path_factory.mktemp("reference")
            config = root / "config.yaml"
            config.write_text(config_text, encoding="utf-8")
            options = {"calib_path": CALIB_TXT, "max_calib_tokens": 32} if calibrated else {}
            msquant.quantize(tiny_llama, root / "out", config, progress=False, **options)
            cache[key] = root / "out"
        return cache[key]

    return build
