"""Copy a model's configuration and tokenizer files next to its quantized weights.

Exports are often published, so only what the model folder itself holds is copied: a symbolic
link pointing outside it (``notes.txt -> ~/.ssh/id_rsa``) is refused instead of copying the
contents of its target. Links inside the folder, and a Hugging Face cache snapshot's links into
its ``blobs`` folder, are followed. Files named like an export's own (a stray
``quant_model_description.json``, ``quantize_config.json``, ``msquant_export.json``,
``quant_report.json``) are never copied: they would replace or contradict what the saver writes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from msquant.errors import ModelLoadError, OutputPathError
from msquant.export.links import link_roots, resolves_inside

__all__ = [
    "COPIED_PATTERNS",
    "copied_model_files",
    "apply_config_updates",
    "copy_model_files",
    "safe_file_stem",
    "strip_quantization_config",
]

_SAFE_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# Config, generation config, tokenizer and chat-template files; never weights or weight indexes.
COPIED_PATTERNS = ("*.json", "*.py", "*.txt", "*.jinja", "*.model", "*.tiktoken")
# Files of an export itself (written by the savers and the run), never taken from the model folder.
EXPORT_FILE_PATTERNS = (
    "*index.json",
    "quant_model_description*.json",
    "quantize_config.json",
    "msquant_export.json",
    "quant_report.json",
)


def copied_model_files(model_path: Path) -> list[Path]:
    """The files :func:`copy_model_files` copies (config, tokenizer, chat template; not indexes
    nor the export's own files).

    :raises ModelLoadError: for one that is a symbolic link to a file outside the model folder.
    """
    roots = link_roots(model_path)
    files = []
    for pattern in COPIED_PATTERNS:
        for source in sorted(model_path.glob(pattern)):
            if any(source.match(excluded) for excluded in EXPORT_FILE_PATTERNS):
                continue
            if source.is_symlink():
                if not resolves_inside(source, roots):
                    real = Path(os.path.realpath(source))
                    raise ModelLoadError(
                        f"{source} is a symbolic link to {real}, outside the model folder; msquant "
                        "copies the model's config and tokenizer files into the export and will "
                        "not copy a file from elsewhere into it: replace the link by a copy of "
                        "the file, or remove it"
                    )
            if source.is_file():
                files.append(source)
    return files


def copy_model_files(
    model_path: Path, output_dir: Path, config_updates: Mapping[str, Any] | None = None
) -> list[str]:
    """Copy config/tokenizer files (not ``*index.json``) and drop ``quantization_config`` from config.json.

    :param config_updates: keys to set in the copied ``config.json`` (also inside its
        ``text_config`` where that holds the key), e.g. ``tie_word_embeddings: false`` for a model
        whose head a processor untied (``RunContext.config_updates``).
    :returns: the names of the copied files, sorted.
    :raises ModelLoadError: for a symbolic link out of the model folder (nothing is copied).
    """
    copied = []
    for source in copied_model_files(model_path):
        shutil.copyfile(source, output_dir / source.name)
        copied.append(source.name)
    config = output_dir / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        changed = strip_quantization_config(data)
        changed = apply_config_updates(data, config_updates or {}) or changed
        if changed:
            config.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return sorted(set(copied))


def apply_config_updates(config: dict[str, Any], updates: Mapping[str, Any]) -> bool:
    """Set ``updates`` at the top level of ``config`` and in its ``text_config`` where that holds
    the key; True if anything was set."""
    text_config = config.get("text_config")
    for key, value in updates.items():
        config[key] = value
        if isinstance(text_config, dict) and key in text_config:
            text_config[key] = value
    return bool(updates)


def strip_quantization_config(config: dict[str, object]) -> bool:
    """Remove ``quantization_config`` at the top level and in ``text_config``; True if any was removed."""
    removed = config.pop("quantization_config", None) is not None
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        removed = text_config.pop("quantization_config", None) is not None or removed
    return removed


def safe_file_stem(value: str, what: str) -> str:
    """``value`` when it is safe inside a file name (letters, digits, ``_ . -``; no ``..``).

    Used for file names built from model metadata (e.g. ``{model_type}_best_practice.yaml``), so
    a crafted ``config.json`` cannot make a saver write outside its folder.

    :raises OutputPathError: naming ``what`` and the offending value.
    """
    if not _SAFE_STEM.fullmatch(value) or ".." in value:
        raise OutputPathError(
            f"{what} {value!r} cannot be used in a file name (allowed: letters, digits, '_', '.', "
            "'-'; no path separators or '..'); fix it in the model's config.json"
        )
    return value
