"""The AWQ format's registry entry: a Hugging Face checkpoint whose ``quant_method`` is ``awq``."""

from __future__ import annotations

from msquant.plugin.reading import hf_export_format
from msquant.processors.formats.awq.reader import AWQReader

__all__ = ["AWQ"]

AWQ = hf_export_format("awq", "awq", AWQReader, savers=("awq_saver",), order=50)
