"""Loaders reading an (unfused, e.g. streamed) model's tensors from the checkpoint's files under
their disk names (:mod:`msquant.model.checkpoint_names`), or, for experts the checkpoint holds
fused, from the fused parameter transformers loaded (:func:`fused_expert_sources`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from msquant.errors import ModelLoadError
from msquant.model.checkpoint_names import CheckpointNames
from msquant.model.moe.experts import FUSED_PARAMS, ROLE_PARAM, ROLES, expert_slice
from msquant.model.moe.unfuse import MoEInfo

__all__ = ["checkpoint_sources", "fused_expert_sources"]

TensorSource = Callable[[], torch.Tensor]


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


def fused_expert_sources(
    experts: MoEInfo, fused: Mapping[str, TensorSource]
) -> dict[str, TensorSource]:
    """Loaders of the expert Linears' weights cut out of their fused parameters.

    For checkpoints that store the experts fused (Qwen3-VL-MoE's ``experts.gate_up_proj``, in
    the model's layout or transposed): transformers converts the fused tensor to the model's
    layout while it loads, so ``fused`` (the streamed sources of the fused parameters, taken
    before :func:`~msquant.model.moe.unfuse_experts`) already reads ``gate_up_proj [E, 2I, H]``
    and ``down_proj [E, H, I]``; each expert Linear gets the same slice as
    :meth:`~msquant.model.moe.UnfusedExperts.from_fused` copies. A fused tensor is read once
    and dropped when all its slices were taken (one layer's experts at a time).

    :param experts: what :func:`~msquant.model.moe.unfuse_experts` replaced.
    :param fused: tensor name -> loader, holding ``<experts>.gate_up_proj`` / ``.down_proj``.
    :returns: ``<experts>.<e>.<role>.weight`` -> loader, for the modules whose fused parameters
        both have a loader.
    """
    sources: dict[str, TensorSource] = {}
    for module in experts.modules:
        loaders = {param: fused.get(f"{module.name}.{param}") for param in FUSED_PARAMS}
        if any(loader is None for loader in loaders.values()):
            continue
        for param, loader in loaders.items():
            assert loader is not None
            roles = [role for role in ROLES if ROLE_PARAM[role] == param]
            cache = _SharedRead(loader, uses=module.num_experts * len(roles))
            for e in range(module.num_experts):
                for role in roles:
                    sources[f"{module.expert_name(e)}.{role}.weight"] = cache.slice_loader(e, role)
    return sources


class _SharedRead:
    """One fused tensor read once for the ``uses`` slices cut out of it, then dropped."""

    def __init__(self, loader: TensorSource, uses: int) -> None:
        self._loader = loader
        self._uses = uses
        self._left = uses
        self._tensor: torch.Tensor | None = None

    def slice_loader(self, expert: int, role: str) -> TensorSource:
        def load() -> torch.Tensor:
            if self._tensor is None:
                self._tensor = self._loader()
                self._left = self._uses
            value = expert_slice(self._tensor, expert, role).clone()
            self._left -= 1
            if self._left <= 0:
                self._tensor = None
            return value

        return load
