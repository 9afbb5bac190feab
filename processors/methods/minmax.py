"""``method: minmax``: round-to-nearest with min/max scales (msModelSlim's numerics), optionally
with the MSE scale search and GPTQModel's symmetric grid."""

from __future__ import annotations

import torch

from msquant.plugin import (
    DYNAMIC_KEYS,
    GPTQ_ONLY_KEYS,
    BaseScheme,
    MethodOptions,
    QDType,
    QScope,
    QuantizedWeight,
    QuantMethod,
    ResolvedScheme,
)
from msquant.processors.methods.options import (
    EXPERT_MIN_TOKENS,
    ExpertMinTokens,
    FullRange,
    GroupSize,
    MseFlag,
    MseGrid,
    MseMaxShrink,
    MseNorm,
    round_to_nearest,
)

__all__ = ["MinMaxExt", "MinMaxMethod"]


class MinMaxExt(MethodOptions):
    """``ext`` options of ``method: minmax`` (round-to-nearest)."""

    group_size: GroupSize = 128
    mse: MseFlag = False
    mse_grid: MseGrid = 100
    mse_maxshrink: MseMaxShrink = 0.2
    mse_norm: MseNorm = 2.4
    full_range: FullRange = False
    expert_min_tokens: ExpertMinTokens = EXPERT_MIN_TOKENS


class MinMaxMethod(QuantMethod):
    """Round-to-nearest: every selected module is quantized on its own, no calibration."""

    name = "minmax"
    options_class = MinMaxExt
    dtypes = frozenset({QDType.INT8, QDType.INT4})
    scopes = frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP})
    summary = "round-to-nearest with min/max scales"
    rule_keys = tuple(key for key in DYNAMIC_KEYS if key not in GPTQ_ONLY_KEYS)
    options: MinMaxExt

    def base_scheme(self) -> BaseScheme:
        options = self.options
        return BaseScheme(
            bits=self.bits,
            group_size=self.group_size,
            sym=self.weight.symmetric,
            mse=options.mse_norm if options.mse else 0.0,
            mse_norm=options.mse_norm,
        )

    def quantize_rtn(
        self, weight: torch.Tensor, scheme: ResolvedScheme, name: str
    ) -> QuantizedWeight:
        options = self.options
        return round_to_nearest(
            weight, scheme, name, options.mse_grid, options.mse_maxshrink, options.full_range
        )
