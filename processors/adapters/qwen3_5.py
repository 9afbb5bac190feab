"""Qwen3.5 (``qwen3_5``, ``qwen3_5_moe`` and their ``*_text`` language models).

Qwen3.5 interleaves full-attention layers with Gated DeltaNet linear-attention layers. transformers
holds a linear-attention layer's input projections as four ``nn.Linear`` s (``linear_attn.in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``); vLLM loads them as two fused matrices,
``in_proj_qkvz`` (qkv + z) and ``in_proj_ba`` (b + a) (``packed_modules_mapping`` of its Qwen3.5
models). Without this adapter msquant would let the shards of one fused matrix differ (one
quantized, its sibling float), an export vLLM refuses ("some but not all shards ... are
quantized") or mis-loads, and ``dynamic`` rules would not be checked against the fused names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from msquant.plugin import ModelAdapter
from msquant.plugin.model import FUSED_SHARDS

__all__ = ["Qwen35Adapter"]


class Qwen35Adapter(ModelAdapter):
    """The default heuristics plus the fused projections of Gated DeltaNet layers, and norms
    scaling by ``1 + weight`` (as Qwen3-Next's: a rotation folds that gain)."""

    norm_scale_offset: ClassVar[float | None] = 1.0

    fused_shards: ClassVar[Mapping[str, tuple[str, ...]]] = {
        **FUSED_SHARDS,
        "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
        "in_proj_ba": ("in_proj_b", "in_proj_a"),
    }
