"""Gemma 2 and Gemma 3 (``gemma2``, ``gemma3``, ``gemma3_text``): sandwich norms scaling by
``1 + weight``.

Each decoder layer normalises the attention's input (``input_layernorm``) and output
(``post_attention_layernorm``), then the MLP's input (``pre_feedforward_layernorm``) and output
(``post_feedforward_layernorm``); only the output norms' results join the residual stream. So the
MLP reads ``pre_feedforward_layernorm``, not ``post_attention_layernorm`` as in Llama, and every
norm computes ``x / rms(x) * (1 + weight)``. Smoothing folds into ``input_layernorm`` -> q/k/v and
``pre_feedforward_layernorm`` -> gate/up (and v -> o, up -> down, as for Llama). A rotation of the
residual stream would pass through the two output norms, which is exact only where their gain is
the same for every channel: ``quarot`` refuses a model whose output norms have learned gains.
"""

from __future__ import annotations

from typing import ClassVar

from msquant.plugin import ModelAdapter
from msquant.plugin.model import NormLayout

__all__ = ["GemmaSandwichAdapter"]


class GemmaSandwichAdapter(ModelAdapter):
    """The default heuristics with Gemma 2/3's norm layout and ``1 + weight`` norms."""

    norm_scale_offset: ClassVar[float | None] = 1.0
    norm_layout: ClassVar[NormLayout] = NormLayout(
        attention="input_layernorm",
        mlp="pre_feedforward_layernorm",
        branch=("post_attention_layernorm", "post_feedforward_layernorm"),
    )
