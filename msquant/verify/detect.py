"""Which export format a folder holds, and the reader for it, from the format registry.

The engine names no format: every format registered in ``msquant.formats``
(:class:`msquant.plugin.FormatRegistry`) is asked in its detection order whether it recognises the
folder. The helpers for Hugging Face checkpoint folders (``config.json`` and its
``quantization_config``) are format-neutral and shared by the formats that need them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msquant.contracts.format import ExportFormat, FormatRegistry, default_formats
from msquant.export.links import links_leaving
from msquant.verify.base import ExportReader
from msquant.verify.errors import ExportReadError
from msquant.verify.report import Findings

__all__ = [
    "detect_format",
    "export_folders",
    "open_reader",
    "read_model_config",
    "hf_quant_method",
    "hf_export_format",
]

_SHOWN_LINKS = 3


def _check_directory(path: Path) -> None:
    """The export folder exists and no symbolic link in it leads out of it (readers would follow
    it: a shard linked to a file elsewhere would be read, hashed and reported on)."""
    if not path.exists():
        raise ExportReadError(f"export folder {path} does not exist")
    if not path.is_dir():
        raise ExportReadError(f"{path} is not a folder; pass the save path of an export")
    leaving = links_leaving(path)
    if leaving:
        shown = "; ".join(f"{name} -> {target}" for name, target in leaving[:_SHOWN_LINKS])
        more = f" and {len(leaving) - _SHOWN_LINKS} more" if len(leaving) > _SHOWN_LINKS else ""
        raise ExportReadError(
            f"{path} holds {len(leaving)} symbolic link(s) to files outside it ({shown}{more}); "
            "msquant reads only the export's own files: replace each link by a copy of its "
            "target, or remove it"
        )


def read_model_config(path: Path) -> dict[str, Any] | None:
    """``path/config.json`` as a dict; None when absent or not a JSON object.

    :raises ExportReadError: when the file exists but is not readable JSON.
    """
    file = path / "config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportReadError(f"{file} is not readable JSON ({exc})") from exc
    return data if isinstance(data, dict) else None


def hf_quant_method(path: Path) -> str | None:
    """``config.json``'s ``quantization_config.quant_method`` (None when there is none): how a
    Hugging Face checkpoint names its quantization format.

    :raises ExportReadError: when ``config.json`` is not readable JSON.
    """
    config = read_model_config(path)
    quantization = config.get("quantization_config") if config else None
    if not isinstance(quantization, dict):
        return None
    method = quantization.get("quant_method")
    return method if isinstance(method, str) else None


def hf_export_format(
    name: str,
    quant_method: str,
    reader: Callable[[Path, Findings, dict[str, Any]], ExportReader],
    savers: tuple[str, ...],
    order: int,
) -> ExportFormat:
    """The registry entry of a Hugging Face checkpoint format: recognised by ``config.json``'s
    ``quantization_config.quant_method``, read by ``reader(folder, findings, config)`` with the
    parsed ``config.json`` (``{}`` when absent)."""

    def detect(directory: Path) -> bool:
        return hf_quant_method(directory) == quant_method

    def open_reader(directory: Path, findings: Findings) -> ExportReader:
        return reader(directory, findings, read_model_config(directory) or {})

    return ExportFormat(
        name=name,
        description=f'config.json quantization_config.quant_method "{quant_method}"',
        detect=detect,
        reader=open_reader,
        savers=savers,
        order=order,
    )


def _find(directory: Path, formats: FormatRegistry) -> ExportFormat:
    _check_directory(directory)
    found = formats.detect(directory)
    if found is not None:
        return found
    config = read_model_config(directory)
    quantization = config.get("quantization_config") if config else None
    if isinstance(quantization, dict):
        raise ExportReadError(
            f"{directory}: config.json quantization_config.quant_method is "
            f"{quantization.get('quant_method')!r}; msquant verify reads "
            f"{', '.join(formats.names())}"
        )
    known = "; ".join(f"{fmt.name}: {fmt.description}" for fmt in formats.formats())
    set_aside = "".join(f"; not looked for: {p.message()}" for p in formats.problems())
    raise ExportReadError(
        f"{directory} holds no export msquant can verify (looked for {known}){set_aside}"
    )


def detect_format(path: str | Path, formats: FormatRegistry | None = None) -> str:
    """The name of the registered format the folder holds (the first in detection order).

    :param formats: the registry to ask (default: every installed format).
    :raises ExportReadError: when the folder is missing or holds none of the formats.
    """
    return _find(Path(path), formats or default_formats()).name


def open_reader(
    path: Path, findings: Findings, formats: FormatRegistry | None = None
) -> ExportReader:
    """The reader for the folder's format (its constructor runs the inventory checks).

    :raises ExportReadError: when no format recognises the folder, or its format has no reader.
    """
    fmt = _find(path, formats or default_formats())
    if fmt.reader is None:
        raise ExportReadError(
            f"{path} holds a {fmt.name} export, which msquant writes but cannot read back "
            "(the format registers no reader)"
        )
    return fmt.reader(path, findings)


def export_folders(path: str | Path, formats: FormatRegistry | None = None) -> list[Path]:
    """The export folders at ``path``: ``[path]`` itself, or, for a run with several savers (each
    writing into its own subfolder), every subfolder holding an export.

    :raises ExportReadError: when neither ``path`` nor any subfolder holds a known format.
    """
    directory = Path(path)
    registry = formats or default_formats()
    _check_directory(directory)
    try:
        _find(directory, registry)
    except ExportReadError:
        subfolders = [
            p for p in sorted(directory.iterdir()) if p.is_dir() and _holds_export(p, registry)
        ]
        if subfolders:
            return subfolders
        raise
    return [directory]


def _holds_export(path: Path, formats: FormatRegistry) -> bool:
    try:
        _find(path, formats)
    except ExportReadError:
        return False
    return True
