"""The compressed-tensors format's registry entry: a Hugging Face checkpoint whose
``quant_method`` is ``compressed-tensors``."""

from __future__ import annotations

from msquant.plugin.reading import hf_export_format
from msquant.processors.formats.compressed_tensors.reader import CompressedTensorsReader

__all__ = ["COMPRESSED_TENSORS"]

COMPRESSED_TENSORS = hf_export_format(
    "compressed-tensors",
    "compressed-tensors",
    CompressedTensorsReader,
    savers=("compressed_tensors",),
    order=40,
)
