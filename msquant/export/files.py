"""Copy a model's configuration and tokenizer files next to its quantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["COPIED_PATTERNS", "copy_model_files", "strip_quantization_config"]

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
