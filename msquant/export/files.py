"""Copy a model's configuration and tokenizer files next to its quantized weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from msquant.errors import OutputPathError

__all__ = ["COPIED_PATTERNS", "copy_model_files", "safe_file_stem", "strip_quantization_config"]

_SAFE_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# Config, generation config, tokenizer and chat-template files; never weights or weight indexes.
COPIED_PATTERNS = ("*.json", "*.py", "*.txt", "*.jinja", "*.model", "*.tiktoken")


def copy_model_files(model_path: Path, output_dir: Path) -> list[str]:
    """Copy config/tokenizer files (not ``*index.json``) and drop ``quantization_config`` from config.json.

    :returns: the names of the copied files, sorted.
    """
    copied = []
    for pattern in COPIED_PATTERNS:
        for source in model_path.glob(pattern):
            if not source.is_file() or source.name.endswith("index.json"):
                continue
            shutil.copyfile(source, output_dir / source.name)
            copied.append(source.name)
    config = output_dir / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        if strip_quantization_config(data):
            config.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return sorted(set(copied))


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
