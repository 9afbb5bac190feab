"""Qwen3-Next (``qwen3_next``): RMSNorms that store their gain minus one.

Qwen3-Next's norms compute ``x / rms(x) * (1 + weight)`` (the weight is zero-centred), where
transformers' other RMSNorms compute ``x / rms(x) * weight``. A residual-stream rotation folds the
gain into the linear layers after each norm: for this model the gain is ``1 + weight``, and the
norm is left computing ``x / rms(x)`` with its weight set to zero. The layers themselves (Gated
DeltaNet linear attention ``in_proj_qkvz`` / ``in_proj_ba`` -> ``out_proj``, gated full
attention, MoE MLPs with a shared expert and its gate) are found by the default heuristics.
"""

from __future__ import annotations

from typing import ClassVar

from msquant.plugin import ModelAdapter

__all__ = ["Qwen3NextAdapter"]


class Qwen3NextAdapter(ModelAdapter):
    """The default heuristics, with norms scaling by ``1 + weight``."""

    norm_scale_offset: ClassVar[float | None] = 1.0
