"""``ext`` fields shared by the built-in methods (MSE scale search, grid, MoE fallback), and the
round-to-nearest every method uses for modules it does not solve."""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field, StrictInt

from msquant.plugin import QuantizedWeight, ResolvedScheme
from msquant.plugin.model import DEFAULT_EXPERT_TOKEN_RATIO
from msquant.plugin.numerics import MSEOptions, quantize_weight_minmax

__all__ = [
    "MseFlag",
    "MseGrid",
    "MseMaxShrink",
    "MseNorm",
    "FullRange",
    "ExpertMinTokens",
    "GroupSize",
    "round_to_nearest",
]

MseFlag = Annotated[
    bool,
    Field(
        description="Search each row's (or group's) scale by shrinking its min/max range to "
        "minimise sum |w - w_q|^mse_norm, instead of plain min/max (off: msModelSlim's numerics)."
    ),
]
MseGrid = Annotated[
    StrictInt,
    Field(
        gt=0,
        le=MSEOptions.max_grid,
        description="MSE search: the range shrinks in steps of 1 / mse_grid "
        f"(1 to {MSEOptions.max_grid}: each step quantizes the weight once more).",
    ),
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
ExpertMinTokens = Annotated[
    float,
    Field(
        ge=0,
        description="MoE experts whose Hessian got fewer calibration tokens than this times their "
        "in_features are rounded to nearest instead of solved by GPTQ (listed in the run report).",
    ),
]
GroupSize = Annotated[
    StrictInt, Field(gt=0, description="Input columns per group (per_group only).")
]

#: Default of ``ext.expert_min_tokens``.
EXPERT_MIN_TOKENS = DEFAULT_EXPERT_TOKEN_RATIO


def round_to_nearest(
    weight: torch.Tensor,
    scheme: ResolvedScheme,
    name: str,
    mse_grid: int,
    mse_maxshrink: float,
    full_range: bool,
) -> QuantizedWeight:
    """Round-to-nearest weight of one module: its resolved scheme (bits, group, sym, MSE norm),
    the entry's MSE search grid and shrink, and its grid convention."""
    mse = None
    if scheme.mse:
        mse = MSEOptions(grid=mse_grid, maxshrink=mse_maxshrink, norm=scheme.mse)
    return quantize_weight_minmax(
        weight, scheme.bits, scheme.sym, scheme.group_size, name=name, mse=mse,
        full_range=full_range,
    )  # fmt: skip
