"""The Ascend formats' registry entries: msModelSlim v1 names and MindIE names, one reader."""

from __future__ import annotations

from msquant.plugin import ExportFormat
from msquant.processors.formats.ascend.detect import is_mindie_export, is_v1_export
from msquant.processors.formats.ascend.reader import AscendReader

__all__ = ["ASCEND", "MINDIE"]

ASCEND = ExportFormat(
    name="ascend",
    description="quant_model_description.json + quant_model_weights*.safetensors (msModelSlim v1)",
    detect=is_v1_export,
    reader=AscendReader,
    savers=("ascendv1_saver",),
    order=10,
)
MINDIE = ExportFormat(
    name="mindie",
    description="quant_model_description[_<type>].json + quant_model_weight[_<type>].safetensors",
    detect=is_mindie_export,
    reader=AscendReader,
    savers=("mindie_format_saver",),
    order=20,
)
