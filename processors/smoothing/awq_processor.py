"""The smoothing processor ``flex_awq_ssz``: msModelSlim's AWQ-style smoothing, whose strength is
searched under the quantization the entry names.

Sample yaml (msModelSlim's W4A8 practices for DeepSeek-V3.2 and GLM-5)::

    spec:
      process:
        - type: flex_awq_ssz
          qconfig:
            act: {scope: per_token, dtype: int8, symmetric: true, method: minmax}
            weight: {scope: per_channel, dtype: int4, symmetric: true, method: ssz, ext: {step: 10}}
          enable_subgraph_type: ['up-down']
          exclude: ['model.layers.0.*', '*mlp.shared_experts.*']
        - type: linear_quant
          qconfig: ...

Per subgraph the scale of each input channel of the consumer is ``max(mean|x|^alpha, 1e-5)``
(the mean absolute activation over every calibration token), folded into the producer as
``flex_smooth_quant``'s scales are; ``alpha`` is given, or chosen from 0, 0.05, ..., 1 by the error
of the consumer's product quantized with ``qconfig`` (:mod:`.awq_search`; at most
:data:`~msquant.processors.smoothing.folding.MAX_SEARCH_TOKENS` tokens, evenly spaced). The
subgraph discovery, include / exclude, ``--model_type`` restriction (msModelSlim asks the same
adapter interface as for ``flex_smooth_quant``), the data-flow proofs and the per-layer function
check are the smoothing processors' (:mod:`.processor`). The ``qconfig`` here only scores the
candidates: the weights are quantized by the ``linear_quant`` entries after it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from msquant.plugin import (
    CalibrationSize,
    ConfigIssue,
    DecoderLayer,
    ProcessorConfig,
    WeightQConfig,
)
from msquant.processors.linear_quant.config import METHODS
from msquant.processors.smoothing.awq_search import WeightFakeQuant
from msquant.processors.smoothing.config import (
    FlexAwqSszConfig,
    awq_qconfig_issues,
    smoothing_issues,
)
from msquant.processors.smoothing.folding import MAX_SEARCH_TOKENS, ScaleRule
from msquant.processors.smoothing.processor import SmoothingProcessor

__all__ = ["FlexAwqSszProcessor", "weight_fake_quant"]

logger = logging.getLogger(__name__)


def weight_fake_quant(weight: WeightQConfig) -> WeightFakeQuant:
    """The dequantized result of ``weight``'s method (round-to-nearest, as ``linear_quant``
    quantizes a module with it) on a candidate's scaled weight."""
    method = METHODS.get(weight.method)(weight)
    scheme = method.base_scheme().resolved()

    def fake_quant(tensor: torch.Tensor) -> torch.Tensor:
        return method.quantize_rtn(tensor, scheme, "flex_awq_ssz candidate").dequantize()

    return fake_quant


def _linear(model: nn.Module, name: str) -> nn.Linear:
    module = model.get_submodule(name)
    assert isinstance(module, nn.Linear)
    return module


class FlexAwqSszProcessor(SmoothingProcessor):
    """``flex_awq_ssz``: AWQ-style smoothing, ``alpha`` searched under the entry's ``qconfig``
    (msModelSlim's defaults: every subgraph type, ``alpha`` searched)."""

    type_name = "flex_awq_ssz"
    config_class = FlexAwqSszConfig
    config: FlexAwqSszConfig
    #: the mean absolute activation and the search need every input row
    keeps_rows = True

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self._fake_quant = weight_fake_quant(self.config.qconfig.weight)

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        assert isinstance(config, FlexAwqSszConfig)
        if config.beta is not None:
            logger.warning(
                "flex_awq_ssz: beta %s is ignored: its scales are mean|a|^alpha (beta 0), as in "
                "msModelSlim",
                config.beta,
            )
        return smoothing_issues(config) + awq_qconfig_issues(config)

    def rule(self) -> ScaleRule:
        return ScaleRule("awq", self.config.alpha, 0.0, fake_quant=self._fake_quant)

    def _act_statistic(self, name: str) -> torch.Tensor | None:
        """The mean of ``|x|`` over every calibration row of ``name``'s input."""
        return self._statistics.mean_abs(name)

    def memory_bytes(
        self, model: nn.Module, layer: DecoderLayer, calibration: CalibrationSize
    ) -> dict[str, int]:
        """The smoothing processors' items, with the mean's and the search's working copies:
        every row joined and its ``|x|`` for the mean; per candidate the scaled and the
        quantized rows, the method's work on the scaled weight and its dequantized copy."""
        items = super().memory_bytes(model, layer, calibration)
        value = calibration.dtype_bytes
        rows = min(calibration.tokens, MAX_SEARCH_TOKENS)
        method = METHODS.get(self.config.qconfig.weight.method)(self.config.qconfig.weight)
        working = 0
        for subgraph in self.selected_subgraphs(model, layer):
            targets = [_linear(model, name) for name in subgraph.targets]
            width = targets[0].in_features
            out_features = sum(t.out_features for t in targets)
            joined = 2 * calibration.tokens * width * value
            search = (
                3 * rows * width * value
                + method.work_bytes(out_features, width)
                + 2 * out_features * width * 4
                + 2 * rows * out_features * value
            )
            working = max(working, joined, search)
        if working:
            items["awq mean and search (largest subgraph)"] = working
        return items
