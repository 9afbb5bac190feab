"""The GPTQ format's registry entry: a Hugging Face checkpoint whose ``quant_method`` is ``gptq``."""

from __future__ import annotations

from msquant.plugin.reading import hf_export_format
from msquant.processors.formats.gptq.reader import GPTQReader

__all__ = ["GPTQ"]

GPTQ = hf_export_format("gptq", "gptq", GPTQReader, savers=("gptq_saver",), order=30)
