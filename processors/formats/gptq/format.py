"""The GPTQ format's registry entry: a Hugging Face checkpoint whose ``quant_method`` is ``gptq``."""

from __future__ import annotations

from pathlib import Path

from msquant import ExportFormat, Findings, hf_quant_method, read_model_config
from msquant.processors.formats.gptq.reader import GPTQReader

__all__ = ["GPTQ", "QUANT_METHOD", "is_gptq_export", "open_gptq_reader"]

QUANT_METHOD = "gptq"


def is_gptq_export(directory: Path) -> bool:
    """Whether ``config.json``'s ``quantization_config.quant_method`` is ``gptq``."""
    return hf_quant_method(directory) == QUANT_METHOD


def open_gptq_reader(directory: Path, findings: Findings) -> GPTQReader:
    """The GPTQ reader of ``directory`` (its constructor runs the inventory checks)."""
    return GPTQReader(directory, findings, read_model_config(directory) or {})


GPTQ = ExportFormat(
    name="gptq",
    description=f'config.json quantization_config.quant_method "{QUANT_METHOD}"',
    detect=is_gptq_export,
    reader=open_gptq_reader,
    savers=("gptq_saver",),
    order=30,
)
