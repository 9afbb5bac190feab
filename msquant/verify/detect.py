"""Which export format a folder holds, and the reader for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from msquant.verify.ascend import AscendReader, description_files
from msquant.verify.base import ExportReader
from msquant.verify.compressed_tensors import CompressedTensorsReader
from msquant.verify.errors import ExportReadError
from msquant.verify.gptq import GPTQReader
from msquant.verify.report import Findings

__all__ = ["FORMATS", "detect_format", "export_folders", "open_reader"]

#: format name -> how it is recognized (for messages and docs).
FORMATS = {
    "ascend": "quant_model_description.json + quant_model_weights*.safetensors (msModelSlim v1)",
    "mindie": "quant_model_description[_<type>].json + quant_model_weight[_<type>].safetensors",
    "gptq": 'config.json quantization_config.quant_method "gptq"',
    "compressed-tensors": 'config.json quantization_config.quant_method "compressed-tensors"',
}
HF_METHODS = {"gptq": "gptq", "compressed-tensors": "compressed-tensors"}


def _check_directory(path: Path) -> None:
    if not path.exists():
        raise ExportReadError(f"export folder {path} does not exist")
    if not path.is_dir():
        raise ExportReadError(f"{path} is not a folder; pass the save path of an export")


def _config(path: Path) -> dict[str, Any] | None:
    file = path / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportReadError(f"{file} is not readable JSON ({exc})") from exc
    return data if isinstance(data, dict) else None


def detect_format(path: str | Path) -> str:
    """``ascend``, ``mindie``, ``gptq`` or ``compressed-tensors``.

    An Ascend description file wins over ``config.json`` (Ascend exports copy the model's config).
    :raises ExportReadError: when the folder is missing or holds none of the formats.
    """
    directory = Path(path)
    _check_directory(directory)
    descriptions = description_files(directory)
    if descriptions:
        v1 = any(directory.glob("quant_model_weights*.safetensors*"))
        suffixed = all(p.name != "quant_model_description.json" for p in descriptions)
        return "ascend" if v1 and not suffixed else "mindie"
    config = _config(directory)
    quantization = config.get("quantization_config") if config else None
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
        if method in HF_METHODS:
            return HF_METHODS[method]
        raise ExportReadError(
            f"{directory}: config.json quantization_config.quant_method is {method!r}; "
            f"msquant verify reads {', '.join(FORMATS)}"
        )
    known = "; ".join(f"{name}: {how}" for name, how in FORMATS.items())
    raise ExportReadError(f"{directory} holds no export msquant can verify (looked for {known})")


def open_reader(path: Path, findings: Findings) -> ExportReader:
    """The reader for the folder's format (its constructor runs the inventory checks)."""
    fmt = detect_format(path)
    if fmt in ("ascend", "mindie"):
        return AscendReader(path, findings)
    config = _config(path) or {}
    if fmt == "gptq":
        return GPTQReader(path, findings, config)
    return CompressedTensorsReader(path, findings, config)


def export_folders(path: str | Path) -> list[Path]:
    """The export folders at ``path``: ``[path]`` itself, or, for a run with several savers (each
    writing into its own subfolder), every subfolder holding an export.

    :raises ExportReadError: when neither ``path`` nor any subfolder holds a known format.
    """
    directory = Path(path)
    _check_directory(directory)
    try:
        detect_format(directory)
    except ExportReadError:
        subfolders = [p for p in sorted(directory.iterdir()) if p.is_dir() and _holds_export(p)]
        if subfolders:
            return subfolders
        raise
    return [directory]


def _holds_export(path: Path) -> bool:
    try:
        detect_format(path)
    except ExportReadError:
        return False
    return True
