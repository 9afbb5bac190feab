"""What the multi-run benchmarks share: random Llama models and the GPTQ config they quantize."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CALIB_TXT = REPO / "tests" / "data" / "calib.txt"


def gptq_int4_config(runner: str = "auto") -> dict[str, Any]:
    """GPTQ int4 group-128 symmetric on every decoder linear, Ascend export."""
    weight = {
        "scope": "per_group",
        "dtype": "int4",
        "symmetric": True,
        "method": "gptq",
        "ext": {"group_size": 128},
    }
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": runner,
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}}],
            "save": [{"type": "ascendv1_saver"}],
        },
    }


def build_model(directory: Path, layers: int, hidden: int, intermediate: int) -> Path:
    """A random Llama with a trained byte-level tokenizer (``tests/tiny_models.py``), built once
    per folder."""
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import build_tiny_model

    if not (directory / "config.json").exists():
        build_tiny_model(
            directory, "llama", hidden_size=hidden, intermediate_size=intermediate,
            num_layers=layers,
        )  # fmt: skip
    return directory
