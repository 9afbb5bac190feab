"""Writing a checkpoint file so that a kill at any moment leaves the old file or the new one: a
temporary file flushed to the disk, then renamed over the old one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from msquant.export.recovery import fsync_directory

__all__ = ["write_json_atomically", "save_tensors_atomically"]


def _replace_durably(tmp: Path, path: Path) -> None:
    """Flush ``tmp`` to the disk and rename it to ``path`` (atomic on one file system)."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def write_json_atomically(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` durably (a kill leaves the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
    _replace_durably(tmp, path)


def save_tensors_atomically(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` as a safetensors file at ``path`` durably."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(dict(tensors), str(tmp), metadata=metadata)
    _replace_durably(tmp, path)
