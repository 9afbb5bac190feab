"""An independent reader of GPTQ checkpoints, written for the tests from the layout spec only.

It does not use msquant (in particular not its packing helpers). Layout (formats.md 3.1), per
quantized linear ``P`` with ``b`` bits:

* ``P.qweight`` int32 ``[in*b/32, out]``: unsigned codes packed along dim 0, least significant bits
  first, as one dense bit stream per column (a 3-bit value may straddle two words);
* ``P.qzeros`` int32 ``[G, out*b/32]``: unsigned zero points packed the same way along dim 1;
  ``checkpoint_format: gptq`` (v1) stores ``(zero - 1) mod 2^b``, ``gptq_v2`` stores ``zero``;
* ``P.scales`` float16 ``[G, out]``, ``P.g_idx`` int32 ``[in]``;
* ``W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])``.

The bits / group size / symmetry of each module come from ``quantization_config`` and its
``dynamic`` rules, resolved as vLLM does (rules in file order, first ``re.match`` wins, ``-:`` means
not quantized); GPTQModel re-orders negative rules first, so both agree when the file has them
first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

WORD = 32
SCHEME_KEYS = ("bits", "group_size", "sym", "desc_act")


def unpack_fields(words: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-wide fields ``0 .. count-1`` of the LSB-first bit stream of ``words``
    (int32) along ``dim``; returns int64 with ``count`` entries along ``dim``."""
    assert words.dtype == torch.int32, words.dtype
    data = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    assert data.shape[-1] * WORD >= count * bits, "too few words for the fields"
    # Explode every word into its 32 bits (bit 0 first), concatenate into one stream per row.
    stream = (data.unsqueeze(-1) >> torch.arange(WORD)) & 1
    stream = stream.reshape(*data.shape[:-1], data.shape[-1] * WORD)[..., : count * bits]
    fields = stream.reshape(*data.shape[:-1], count, bits)
    values = (fields << torch.arange(bits)).sum(dim=-1)
    return values.movedim(-1, dim)


def resolve_scheme(config: dict[str, Any], module: str) -> dict[str, Any] | None:
    """The scheme of ``module`` after ``dynamic`` (``None`` when a negative rule matches)."""
    base = {key: config[key] for key in SCHEME_KEYS}
    for pattern, override in config.get("dynamic", {}).items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], module):
                return None
            continue
        raw = pattern[2:] if pattern.startswith("+:") else pattern
        if re.match(raw, module):
            return {**base, **{k: v for k, v in override.items() if k in SCHEME_KEYS}}
    return base


@dataclass
class GPTQModule:
    """One quantized linear as stored: codes ``[out, in]``, true zero points ``[G, out]``."""

    name: str
    bits: int
    group_size: int
    sym: bool
    codes: torch.Tensor
    zeros: torch.Tensor
    stored_zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    bias: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the checkpoint represents."""
        index = self.g_idx.long()
        scales = self.scales.float()[index]  # [in, out]
        zeros = self.zeros[index]  # [in, out]
        return ((self.codes.t() - zeros).float() * scales).t()


@dataclass
class GPTQExport:
    config: dict[str, Any]
    quantization_config: dict[str, Any]
    quantize_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    files: list[str]
    modules: dict[str, GPTQModule]


def _read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(str(directory / name))
        assert not set(part) & set(tensors), f"tensors in two shards: {set(part) & set(tensors)}"
        if weight_map is not None:
            assert {t for t, f in weight_map.items() if f == name} == set(part), name
        tensors.update(part)
    return tensors, files


def read_module(
    name: str, tensors: dict[str, torch.Tensor], scheme: dict[str, Any], fmt: str
) -> GPTQModule:
    bits, group_size = int(scheme["bits"]), int(scheme["group_size"])
    qweight, qzeros = tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"]
    scales, g_idx = tensors[f"{name}.scales"], tensors[f"{name}.g_idx"]
    in_features, out_features = g_idx.shape[0], qweight.shape[1]
    groups = 1 if group_size == -1 else -(-in_features // group_size)
    assert qweight.dtype == qzeros.dtype == g_idx.dtype == torch.int32, name
    assert scales.dtype == torch.float16, name
    assert tuple(qweight.shape) == (in_features * bits // WORD, out_features), name
    assert tuple(qzeros.shape) == (groups, out_features * bits // WORD), name
    assert tuple(scales.shape) == (groups, out_features), name
    codes = unpack_fields(qweight, bits, in_features, dim=0).t().contiguous()
    stored = unpack_fields(qzeros, bits, out_features, dim=1)
    zeros = torch.remainder(stored + 1, 2**bits) if fmt == "gptq" else stored
    bias = tensors.get(f"{name}.bias")
    return GPTQModule(
        name, bits, group_size, bool(scheme["sym"]), codes, zeros, stored, scales, g_idx, bias
    )


def read_gptq_export(directory: Path) -> GPTQExport:
    """Read ``directory`` (single file or sharded) and unpack every ``*.qweight`` module."""
    config = json.loads((directory / "config.json").read_text())
    quantize_config = json.loads((directory / "quantize_config.json").read_text())
    qc = config["quantization_config"]
    assert qc["checkpoint_format"] in ("gptq", "gptq_v2")
    tensors, files = _read_tensors(directory)
    modules = {}
    for key in tensors:
        if not key.endswith(".qweight"):
            continue
        name = key[: -len(".qweight")]
        scheme = resolve_scheme(qc, name)
        assert scheme is not None, f"{name} is stored quantized but a negative rule matches it"
        modules[name] = read_module(name, tensors, scheme, qc["checkpoint_format"])
    return GPTQExport(config, qc, quantize_config, tensors, files, modules)
