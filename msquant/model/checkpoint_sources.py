"""Loaders reading an (unfused, e.g. streamed) model's tensors from the checkpoint's files under
their disk names (:mod:`msquant.model.checkpoint_names`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from msquant.errors import ModelLoadError
from msquant.model.checkpoint_names import CheckpointNames

__all__ = ["checkpoint_sources"]


def checkpoint_sources(
    model: nn.Module, names: CheckpointNames, checkpoint_dir: Path
) -> dict[str, Callable[[], torch.Tensor]]:
    """Loaders reading each tensor of ``model`` from the checkpoint under its disk name.

    Every parameter and buffer of ``model`` (an unfused model, e.g. still on the ``meta``
    device) whose disk name is in ``checkpoint_dir``'s safetensors files gets a loader; the others
    (tied copies, non-persistent buffers, converted tensors) are left out. This lets a streamed
    run fill an unfused layer's expert Linears straight from the per-expert tensors on disk,
    never building the fused 3-D parameters.

    :raises ModelLoadError: the folder has no ``model.safetensors`` nor
        ``model.safetensors.index.json``.
    """
    files = _checkpoint_files(checkpoint_dir)
    sources: dict[str, Callable[[], torch.Tensor]] = {}
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        try:
            disk = names.tensor_name(name)
        except LookupError:
            continue
        if disk in files:
            sources[name] = _safetensors_loader(files[disk], disk)
    return sources


def _checkpoint_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Disk tensor name -> safetensors file holding it."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {key: checkpoint_dir / file for key, file in weight_map.items()}
    single = checkpoint_dir / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{checkpoint_dir} has no model.safetensors(.index.json)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def _safetensors_loader(file: Path, key: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(key)

    return load
