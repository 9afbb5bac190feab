"""An independent reader of the Ascend (msModelSlim v1) export, written for the tests only.

It does not use msquant: it reads the safetensors files (single or sharded via the index) and the
description JSON, and dequantizes W8A16 and W4A16 weights with
``(weight - weight_offset) * weight_scale`` (W4A16: two signed int4 codes per int8 byte along the
input dimension, even column in the low nibble).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

GLOBAL_KEYS = ("version", "model_quant_type", "metadata", "group_size", "optional")


@dataclass
class AscendExport:
    tensors: dict[str, torch.Tensor]
    description: dict[str, object]
    files: list[str]

    @property
    def types(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.description.items() if k not in GLOBAL_KEYS}

    def quantized_modules(self) -> list[str]:
        return [
            k[: -len(".weight")]
            for k, v in self.types.items()
            if k.endswith(".weight") and v in ("W8A16", "W4A16")
        ]

    def codes(self, module: str) -> torch.Tensor:
        """Signed integer codes ``[out, in]`` of a quantized module."""
        stored = self.tensors[f"{module}.weight"]
        if self.types[f"{module}.weight"] != "W4A16":
            return stored.to(torch.int16)
        byte = stored.to(torch.int16) & 0xFF
        low, high = byte & 0xF, byte >> 4
        low = torch.where(low > 7, low - 16, low)
        high = torch.where(high > 7, high - 16, high)
        return torch.stack([low, high], dim=-1).reshape(stored.shape[0], stored.shape[1] * 2)

    def dequantized(self, module: str) -> torch.Tensor:
        q = self.codes(module)
        scale = self.tensors[f"{module}.weight_scale"]
        offset = self.tensors[f"{module}.weight_offset"]
        out_f, in_f = q.shape
        groups = scale.shape[1]
        g = in_f // groups
        w = (q.float().reshape(out_f, groups, g) - offset.unsqueeze(-1)) * scale.unsqueeze(-1)
        return w.reshape(out_f, in_f)


def read_ascend_export(
    directory: Path,
    weights_stem: str = "quant_model_weights",
    description_file: str = "quant_model_description.json",
) -> AscendExport:
    index = directory / f"{weights_stem}.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = [f"{weights_stem}.safetensors"]
        weight_map = None
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(str(directory / name))
        assert not set(part) & set(tensors), f"tensor in two shards: {set(part) & set(tensors)}"
        tensors.update(part)
    if weight_map is not None:
        assert set(weight_map) == set(tensors)
        for tensor, file in weight_map.items():
            assert tensor in load_file(str(directory / file))
    description = json.loads((directory / description_file).read_text())
    return AscendExport(tensors, description, files)
