"""Weight quantization methods known to ``linear_quant`` and the option schema (``ext``) of each.

This table is what decides, before any model is loaded, whether a ``(dtype, scope, method)``
combination is implemented and whether its ``ext`` options are valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from msquant.model.moe import DEFAULT_EXPERT_TOKEN_RATIO
from msquant.quant.mse_clip import MSEOptions
from msquant.quant.qconfig import QDType, QScope

__all__ = ["MinMaxExt", "GPTQExt", "WeightMethod", "WEIGHT_METHODS"]

# The MSE clipping search options, shared by minmax and gptq (see msquant.quant.mse_clip).
MseFlag = Annotated[
    bool,
    Field(
        description="Search each row's (or group's) scale by shrinking its min/max range to "
        "minimise sum |w - w_q|^mse_norm, instead of plain min/max (off: msModelSlim's numerics)."
    ),
]
MseGrid = Annotated[
    StrictInt, Field(gt=0, description="MSE search: the range shrinks in steps of 1 / mse_grid.")
]
MseMaxShrink = Annotated[
    float,
    Field(
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="MSE search: the largest fraction of the range that may be cut.",
    ),
]
MseNorm = Annotated[
    float,
    Field(
        gt=0,
        allow_inf_nan=False,
        description="MSE search: exponent of the error measured, sum |w - w_q|^mse_norm.",
    ),
]
FullRange = Annotated[
    bool,
    Field(
        description="Symmetric only: scale = max|w| / (2^(b-1) - 0.5), using the code -2^(b-1) "
        "(GPTQModel's and llm-compressor's convention: a 7 % finer step at int4, 0.4 % at int8) "
        "instead of msModelSlim's max|w| / (2^(b-1) - 1). Pays off at int4; at int8 with small "
        "groups it can cost more than it saves. Default false: msModelSlim's numerics."
    ),
]


class MinMaxExt(BaseModel):
    """``ext`` options of ``method: minmax`` (round-to-nearest)."""

    model_config = ConfigDict(extra="forbid")

    group_size: StrictInt = Field(
        128, gt=0, description="Input columns per group (per_group only)."
    )
    mse: MseFlag = False
    mse_grid: MseGrid = 100
    mse_maxshrink: MseMaxShrink = 0.2
    mse_norm: MseNorm = 2.4
    full_range: FullRange = False
    expert_min_tokens: float = Field(
        DEFAULT_EXPERT_TOKEN_RATIO,
        ge=0,
        description="MoE experts whose Hessian got fewer calibration tokens than this times their "
        "in_features are rounded to nearest instead of solved by GPTQ (listed in the run report).",
    )

    def mse_options(self) -> MSEOptions | None:
        """The MSE search options, or None when ``mse`` is off (plain min/max)."""
        return MSEOptions.from_flags(self.mse, self.mse_grid, self.mse_maxshrink, self.mse_norm)


class GPTQExt(BaseModel):
    """``ext`` options of ``method: gptq``: msModelSlim's (percdamp, block_size, group_size), plus
    act-order, static groups, the Cholesky retry policy and the MSE clipping search."""

    model_config = ConfigDict(extra="forbid")

    percdamp: float = Field(
        0.01,
        gt=0,
        allow_inf_nan=False,
        description="Damping as a fraction of the mean Hessian diagonal.",
    )
    block_size: StrictInt = Field(
        128,
        gt=0,
        description="Lazy-batch width over input columns (the last block may be shorter).",
    )
    group_size: StrictInt = Field(
        128, gt=0, description="Input columns per group (per_group only)."
    )
    desc_act: bool = Field(
        False, description="Act-order: process columns by descending Hessian diagonal."
    )
    static_groups: bool = Field(
        False,
        description="Fix group scales from the original weight before the sweep (forced with desc_act).",
    )
    damp_auto_increment: float = Field(
        0.01,
        ge=0,
        allow_inf_nan=False,
        description="Added to percdamp after each failed Cholesky factorisation.",
    )
    max_damp_retries: StrictInt = Field(
        10, ge=0, description="How many damping increases are tried before giving up."
    )
    mse: MseFlag = False
    mse_grid: MseGrid = 100
    mse_maxshrink: MseMaxShrink = 0.2
    mse_norm: MseNorm = 2.4
    full_range: FullRange = False
    expert_min_tokens: float = Field(
        DEFAULT_EXPERT_TOKEN_RATIO,
        ge=0,
        description="MoE experts whose Hessian got fewer calibration tokens than this times their "
        "in_features are rounded to nearest instead of solved by GPTQ (listed in the run report).",
    )
    experts_per_pass: StrictInt | None = Field(
        None,
        gt=0,
        description="MoE: gather the Hessians of at most this many experts per calibration pass "
        "over a layer (each pass solves its experts, then frees their Hessians), bounding GPTQ "
        "memory for models with many wide experts at the cost of one more layer forward per "
        "pass; the result is identical. Default: all experts in one pass.",
    )

    def mse_options(self) -> MSEOptions | None:
        """The MSE search options, or None when ``mse`` is off (plain min/max)."""
        return MSEOptions.from_flags(self.mse, self.mse_grid, self.mse_maxshrink, self.mse_norm)


@dataclass(frozen=True)
class WeightMethod:
    """A weight quantization algorithm selectable by ``qconfig.weight.method``."""

    name: str
    ext_model: type[BaseModel]
    dtypes: frozenset[QDType]
    scopes: frozenset[QScope]
    implemented: bool
    summary: str


WEIGHT_METHODS: Mapping[str, WeightMethod] = MappingProxyType(
    {
        "minmax": WeightMethod(
            name="minmax",
            ext_model=MinMaxExt,
            dtypes=frozenset({QDType.INT8, QDType.INT4}),
            scopes=frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP}),
            implemented=True,
            summary="round-to-nearest with min/max scales",
        ),
        "gptq": WeightMethod(
            name="gptq",
            ext_model=GPTQExt,
            dtypes=frozenset({QDType.INT8, QDType.INT4}),
            scopes=frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP}),
            implemented=True,
            summary="GPTQ (Hessian-based error compensation)",
        ),
    }
)
