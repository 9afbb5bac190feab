"""The compressed-tensors format's registry entry: a Hugging Face checkpoint whose
``quant_method`` is ``compressed-tensors``."""

from __future__ import annotations

from pathlib import Path

from msquant import ExportFormat, Findings, hf_quant_method, read_model_config
from msquant.processors.formats.compressed_tensors.reader import CompressedTensorsReader

__all__ = ["COMPRESSED_TENSORS", "QUANT_METHOD", "is_compressed_tensors_export"]

QUANT_METHOD = "compressed-tensors"


def is_compressed_tensors_export(directory: Path) -> bool:
    """Whether ``config.json``'s ``quantization_config.quant_method`` is ``compressed-tensors``."""
    return hf_quant_method(directory) == QUANT_METHOD


def open_compressed_tensors_reader(directory: Path, findings: Findings) -> CompressedTensorsReader:
    """The compressed-tensors reader of ``directory`` (its constructor runs the inventory checks)."""
    return CompressedTensorsReader(directory, findings, read_model_config(directory) or {})


COMPRESSED_TENSORS = ExportFormat(
    name="compressed-tensors",
    description=f'config.json quantization_config.quant_method "{QUANT_METHOD}"',
    detect=is_compressed_tensors_export,
    reader=open_compressed_tensors_reader,
    savers=("compressed_tensors",),
    order=40,
)
