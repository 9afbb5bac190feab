"""The safetensors file format, as msquant writes it: dtype names, the header, and one file
assembled from a header and the data files that hold its tensors' bytes.

Kept apart from the streamed writer (:mod:`msquant.export.shards`), which decides what goes into
which file and when, and checkpoints that; this module only knows the bytes of one file: an
8-byte little-endian header length, the JSON header (``__metadata__`` first) padded with spaces to
a multiple of 8 bytes, then the data section.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "COPY_CHUNK_BYTES",
    "METADATA_KEY",
    "header_bytes",
    "require_little_endian",
    "safetensors_dtype",
    "write_shard_file",
]

#: Bytes copied at a time from a shard's data file into the final file.
COPY_CHUNK_BYTES = 16 * 1024**2

METADATA_KEY = "__metadata__"
_METADATA = {"format": "pt"}
_HEADER_ALIGNMENT = 8


def _dtype_names() -> dict[torch.dtype, str]:
    """Torch dtypes and their names in the safetensors format (those this torch build has)."""
    names = {
        "float64": "F64",
        "float32": "F32",
        "float16": "F16",
        "bfloat16": "BF16",
        "int64": "I64",
        "int32": "I32",
        "int16": "I16",
        "int8": "I8",
        "uint8": "U8",
        "bool": "BOOL",
        "float8_e4m3fn": "F8_E4M3",
        "float8_e4m3fnuz": "F8_E4M3FNUZ",
        "float8_e5m2": "F8_E5M2",
        "float8_e5m2fnuz": "F8_E5M2FNUZ",
        "complex64": "C64",
        "uint16": "U16",
        "uint32": "U32",
        "uint64": "U64",
    }
    return {getattr(torch, attr): name for attr, name in names.items() if hasattr(torch, attr)}


_DTYPE_NAMES = _dtype_names()


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype`` (``torch.bfloat16`` -> ``"BF16"``).

    :raises ValueError: the format has no name for it (e.g. complex128, quantized dtypes).
    """
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in _DTYPE_NAMES))
        raise ValueError(
            f"safetensors cannot store dtype {dtype}; supported: {supported}"
        ) from None


def require_little_endian() -> None:
    """safetensors stores little-endian bytes; raw tensor bytes of a big-endian host are not."""
    if sys.byteorder != "little":
        raise RuntimeError(
            f"writing safetensors files needs a little-endian host; this one is {sys.byteorder}-endian"
        )


def header_bytes(entries: dict[str, dict[str, Any]]) -> bytes:
    """The shard header: JSON with metadata first, space-padded to a multiple of 8 bytes."""
    header = {METADATA_KEY: _METADATA, **entries}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % _HEADER_ALIGNMENT)
    return text


def write_shard_file(
    path: Path, entries: dict[str, dict[str, Any]], data_paths: Sequence[Path]
) -> None:
    """Write the safetensors file ``path``: header ``entries``, then the ``data_paths`` bytes.

    ``entries`` hold offsets into the concatenation of ``data_paths``; the data is copied in
    chunks of :data:`COPY_CHUNK_BYTES`, never whole.
    """
    header = header_bytes(entries)
    with open(path, "wb") as out:
        out.write(len(header).to_bytes(8, "little"))
        out.write(header)
        for data_path in data_paths:
            with open(data_path, "rb") as data:
                shutil.copyfileobj(data, out, COPY_CHUNK_BYTES)
