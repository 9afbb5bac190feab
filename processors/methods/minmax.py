"""``method: minmax``: round-to-nearest with min/max scales (msModelSlim's numerics), optionally
with the MSE scale search and GPTQModel's symmetric grid; for the MX value types (``mxfp8`` /
``mxfp4``, ``scope: per_block``) and FP8 (``fp8_e4m3``, ``scope: per_channel``) the value type's
own quantization (:meth:`msquant.plugin.ValueType.quantize`), as msModelSlim's ``minmax`` does
for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import Field, StrictInt, field_validator

from msquant.plugin import (
    BaseScheme,
    ConfigIssue,
    DynamicRule,
    MethodOptions,
    QDType,
    QScope,
    QuantizedWeight,
    QuantMethod,
    ResolvedScheme,
)
from msquant.plugin.planning import DYNAMIC_KEYS, GPTQ_ONLY_KEYS
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

#: The block value types ``minmax`` quantizes with ``scope: per_block`` (every dtype whose value
#: type computes its own scales: mxfp8, mxfp4).
MX_DTYPES = tuple(
    dtype for dtype in QDType if dtype.self_scaled and dtype.value_type.block_size is not None
)
#: The per-channel float dtypes whose value type computes its own scales (``fp8_e4m3``:
#: ``amax / 448`` per output channel, msModelSlim's FP8 ``minmax``), symmetric only.
FLOAT_CHANNEL_DTYPES = tuple(
    dtype for dtype in QDType if dtype.self_scaled and dtype.value_type.block_size is None
)
#: The scopes of integer weights.
INT_SCOPES = (QScope.PER_CHANNEL, QScope.PER_GROUP)

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
    axes: StrictInt = Field(
        -1,
        description="MX (per_block) only: the dimension blocks of 32 run along; -1 (the input "
        "features: msModelSlim's default, the only one its linear layers use) is the one "
        "implemented.",
    )

    @field_validator("axes")
    @classmethod
    def _last_axis(cls, value: int) -> int:
        if value != -1:
            raise ValueError(
                f"MX blocks run along the input features (axes: -1); axes {value} is not "
                "implemented"
            )
        return value


class MinMaxMethod(QuantMethod):
    """Round-to-nearest: every selected module is quantized on its own, no calibration."""

    name = "minmax"
    options_class = MinMaxExt
    dtypes = frozenset({QDType.INT8, QDType.INT4, *MX_DTYPES, *FLOAT_CHANNEL_DTYPES})
    scopes = frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP, QScope.PER_BLOCK})
    summary = "round-to-nearest with min/max scales"
    rule_keys = tuple(key for key in DYNAMIC_KEYS if key not in GPTQ_ONLY_KEYS)
    options: MinMaxExt

    def config_issues(self, rules: Sequence[DynamicRule]) -> list[ConfigIssue]:
        """``per_block`` goes with the MX dtypes and they with it (their block is fixed)."""
        weight = self.weight
        if weight.dtype in FLOAT_CHANNEL_DTYPES:
            if weight.scope is QScope.PER_CHANNEL and weight.symmetric:
                return []
            return [
                ConfigIssue(
                    "qconfig.weight",
                    f"{weight.dtype.value} weights are per_channel symmetric for method minmax "
                    f"(msModelSlim's FP8 weights: one amax / 448 scale per output channel), got "
                    f"scope {weight.scope.value}, symmetric {str(weight.symmetric).lower()}",
                )
            ]
        if (weight.scope is QScope.PER_BLOCK) == (weight.dtype in MX_DTYPES):
            return []
        combos = sorted(
            [(d.value, s.value) for d in (QDType.INT8, QDType.INT4) for s in INT_SCOPES]
            + [(d.value, QScope.PER_BLOCK.value) for d in MX_DTYPES]
            + [(d.value, QScope.PER_CHANNEL.value) for d in FLOAT_CHANNEL_DTYPES]
        )
        return [
            ConfigIssue(
                "qconfig.weight",
                f"(dtype {weight.dtype.value}, scope {weight.scope.value}) is not implemented "
                "for method minmax (scope per_block is for the MX dtypes, which take only it); "
                f"implemented (dtype, scope): {', '.join(f'({d}, {s})' for d, s in combos)}",
            )
        ]

    def base_scheme(self) -> BaseScheme:
        options = self.options
        values = self.weight.dtype.value_type
        if values.self_scaled:
            return BaseScheme(
                bits=values.bits,
                group_size=values.block_size,
                sym=True,
                value_type=values.name,
            )
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
        values = scheme.values
        if values.self_scaled:
            return QuantizedWeight.self_scaled(weight, values)
        return round_to_nearest(
            weight, scheme, name, options.mse_grid, options.mse_maxshrink, options.full_range
        )
