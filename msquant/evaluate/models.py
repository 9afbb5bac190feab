"""The model a folder holds, for evaluation: a float Hugging Face model, or an msquant export read
back (:mod:`msquant.verify.rebuild`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from msquant.contracts.format import FormatRegistry, default_formats
from msquant.errors import ModelLoadError
from msquant.load.model_folder import check_model_dir, load_causal_lm
from msquant.verify.detect import detect_format, export_folders
from msquant.verify.errors import ExportReadError
from msquant.verify.rebuild import load_export

__all__ = ["FLOAT_KIND", "model_kind", "max_positions", "load_model_for_eval"]


FLOAT_KIND = "float"


def model_kind(model_dir: str | Path, formats: FormatRegistry | None = None) -> str:
    """``float`` for a plain Hugging Face model folder, else the export format.

    :param formats: the export formats to recognise (default: every installed one).
    :raises ModelLoadError: when the folder is missing or holds neither a model nor an export.
    :raises ExportReadError: when it holds an export in a format msquant cannot read, or a
        several-saver save path (the message lists the subfolders to choose from).
    """
    path = Path(model_dir)
    if not path.exists():
        raise ModelLoadError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a folder; pass a model folder or an export folder")
    registry = formats or default_formats()
    if _has_quantization_config(path) or _recognised(path, registry):
        return detect_format(path, registry)
    if (path / "config.json").is_file():
        return FLOAT_KIND
    try:
        folders = export_folders(path, registry)
    except ExportReadError:
        raise ModelLoadError(
            f"{path} holds neither a Hugging Face model (config.json) nor an msquant export"
        ) from None
    names = ", ".join(str(folder) for folder in folders)
    raise ExportReadError(
        f"{path} holds the exports of several savers; evaluate one of them: {names}"
    )


def _recognised(path: Path, formats: FormatRegistry) -> bool:
    """Whether a registered format recognises the folder; a metadata file it cannot parse (a
    broken ``config.json`` beside float weights) leaves the folder to the float loader."""
    try:
        return formats.detect(path) is not None
    except ExportReadError:
        return False


def _has_quantization_config(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("quantization_config"), dict)


def max_positions(config: Any) -> int | None:
    """The model's longest sequence (``max_position_embeddings``, also under ``text_config``)."""
    for holder in (config, getattr(config, "text_config", None)):
        value = getattr(holder, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_model_for_eval(
    model_dir: str | Path, trust_remote_code: bool = False, formats: FormatRegistry | None = None
) -> tuple[nn.Module, str]:
    """The model of a folder on CPU in eval mode, and its kind (``float`` or the export format).

    A float folder is loaded with ``from_pretrained`` (safetensors only); an export is rebuilt
    from its ``config.json`` with its float tensors and dequantized linear weights, read by the
    reader of its registered format (``formats``; default: every installed one).

    :raises ModelLoadError: for a missing or unloadable folder.
    :raises ExportReadError: for an export that cannot be read back consistently.
    """
    registry = formats or default_formats()
    kind = model_kind(model_dir, registry)
    path = Path(model_dir)
    if kind == FLOAT_KIND:
        return load_causal_lm(check_model_dir(path), trust_remote_code), kind
    return load_export(path, trust_remote_code, registry), kind
