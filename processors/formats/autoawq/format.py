"""The AutoAWQ format's registry entry: a Hugging Face checkpoint whose ``quant_method`` is
``awq`` (the name AutoAWQ writes and vLLM / transformers read; detection goes by that content, so
exports written when the format was still called ``awq`` are recognised alike)."""

from __future__ import annotations

from msquant.plugin.reading import hf_export_format
from msquant.processors.formats.autoawq.reader import AutoAWQReader

__all__ = ["AUTOAWQ"]

AUTOAWQ = hf_export_format(
    "autoawq", "awq", AutoAWQReader, savers=("autoawq_saver", "awq_saver"), order=50
)
