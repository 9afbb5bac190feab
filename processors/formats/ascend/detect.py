"""How an Ascend export folder is recognised, and which naming it uses (v1 or MindIE).

msModelSlim v1 writes ``quant_model_description.json`` with ``quant_model_weights*.safetensors``;
MindIE's naming is ``quant_model_description[_<type>].json`` with
``quant_model_weight[_<type>].safetensors``. A description file wins over ``config.json`` (Ascend
exports copy the model's config), so these formats come first in detection order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

__all__ = [
    "DESCRIPTION_STEM",
    "V1_WEIGHTS",
    "MINDIE_WEIGHTS",
    "description_files",
    "ascend_naming",
    "is_v1_export",
    "is_mindie_export",
]

DESCRIPTION_STEM = "quant_model_description"
V1_WEIGHTS = "quant_model_weights"
MINDIE_WEIGHTS = "quant_model_weight"


def description_files(directory: Path) -> list[Path]:
    """The ``quant_model_description*.json`` files in ``directory``, sorted."""
    return sorted(p for p in directory.glob(f"{DESCRIPTION_STEM}*.json") if p.is_file())


def ascend_naming(directory: Path) -> Literal["ascend", "mindie"] | None:
    """``ascend`` (v1 names), ``mindie`` (MindIE names) or None (no description file)."""
    descriptions = description_files(directory)
    if not descriptions:
        return None
    v1 = any(directory.glob(f"{V1_WEIGHTS}*.safetensors*"))
    suffixed = all(p.name != f"{DESCRIPTION_STEM}.json" for p in descriptions)
    return "ascend" if v1 and not suffixed else "mindie"


def is_v1_export(directory: Path) -> bool:
    """Whether ``directory`` holds an Ascend export under msModelSlim v1's names."""
    return ascend_naming(directory) == "ascend"


def is_mindie_export(directory: Path) -> bool:
    """Whether ``directory`` holds an Ascend export under MindIE's names."""
    return ascend_naming(directory) == "mindie"
