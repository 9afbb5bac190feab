"""Fixtures of the red-team replays: a case folder holding a copy of the tiny model and the
configs, so that :func:`replay.tree` sees everything a run could touch."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parents[2]
CALIB_TXT = REPO / "tests" / "data" / "calib.txt"

MINMAX_YAML = """\
apiversion: modelslim_v1
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {dtype: int8, scope: per_channel, symmetric: true, method: minmax}
"""

GPTQ_YAML = """\
apiversion: modelslim_v1
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {dtype: int8, scope: per_channel, symmetric: true, method: gptq}
"""


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


def quant_args(root: Path, *extra: object, config: str = "w8.yaml") -> list[object]:
    """``quant`` on the case's model and config, saving to ``out`` (unless ``extra`` says)."""
    args: list[object] = ["quant", "--model_path", root / "model", "--config_path", root / config]
    if "--save_path" not in extra:
        args += ["--save_path", root / "out"]
    if config == "gptq.yaml":
        args += ["--calib_path", CALIB_TXT, "--max_calib_tokens", "32"]
    return [*args, "--no_progress", *extra]


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
