"""``method: hessian_clip``: round-to-nearest whose clipping range is chosen per row (or group)
to minimise the layer's output error on the calibration data (AWQ's clip search, on the layer's
Hessian; the numerics are :mod:`msquant.quant.clip_search`). Cheaper than GPTQ (no solve, no
error feedback between columns), better than min/max where a few weights set the range."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field, StrictInt

from msquant.plugin import (
    BaseScheme,
    CalibratedQuantizer,
    MethodOptions,
    QDType,
    QScope,
    QuantizedWeight,
    QuantMethod,
    ResolvedScheme,
)
from msquant.plugin.devices import Backend
from msquant.plugin.numerics import (
    HessianAccumulator,
    MSEOptions,
    quantize_weight_hessian_clip,
    quantize_weight_minmax,
)
from msquant.plugin.planning import DYNAMIC_KEYS, GPTQ_ONLY_KEYS
from msquant.processors.methods.options import GroupSize

__all__ = ["HessianClipExt", "HessianClipMethod", "HessianOnly"]


class HessianClipExt(MethodOptions):
    """``ext`` options of ``method: hessian_clip``."""

    group_size: GroupSize = 128
    clip_grid: StrictInt = Field(
        20,
        gt=0,
        le=MSEOptions.max_grid,
        description="The range shrinks in steps of 1 / clip_grid "
        f"(1 to {MSEOptions.max_grid}: each step quantizes the weight once more).",
    )
    clip_maxshrink: float = Field(
        0.5,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="The largest fraction of a row's (group's) range that may be cut.",
    )


class HessianOnly:
    """A module's calibration state for ``hessian_clip``: its Hessian, and the module's scheme."""

    def __init__(self, name: str, in_features: int, scheme: ResolvedScheme) -> None:
        self.name = name
        self.scheme = scheme
        self.accumulator = HessianAccumulator(in_features, name=name)

    @property
    def nsamples(self) -> int:
        """Calibration tokens gathered (padding excluded)."""
        return self.accumulator.n

    def add_batch(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Gather one batch of the module's inputs."""
        self.accumulator.add_batch(x, attention_mask)


class HessianClipMethod(QuantMethod):
    """Activation-aware clipping: each row's (group's) range minimises its output error."""

    name = "hessian_clip"
    options_class = HessianClipExt
    dtypes = frozenset({QDType.INT8, QDType.INT4})
    scopes = frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP})
    summary = (
        "round-to-nearest, each range clipped to minimise the output error on calibration data"
    )
    calibrated = True
    rule_keys = tuple(key for key in DYNAMIC_KEYS if key not in (*GPTQ_ONLY_KEYS, "mse"))
    options: HessianClipExt

    def base_scheme(self) -> BaseScheme:
        return BaseScheme(bits=self.bits, group_size=self.group_size, sym=self.weight.symmetric)

    def quantize_rtn(
        self, weight: torch.Tensor, scheme: ResolvedScheme, name: str
    ) -> QuantizedWeight:
        """Plain min/max (the run report's baseline, and MoE experts that received no token)."""
        return quantize_weight_minmax(weight, scheme.bits, scheme.sym, scheme.group_size, name)

    def new_quantizer(
        self, name: str, in_features: int, scheme: ResolvedScheme
    ) -> CalibratedQuantizer:
        return HessianOnly(name, in_features, scheme)

    def work_bytes(self, out_features: int, in_features: int) -> int:
        """The clip search's float32 working copies: five of the weight (its values, a fake-
        quantized candidate, their difference, the product with the Hessian blocks and a
        temporary) and the Hessian's diagonal blocks (at most one Hessian)."""
        return 4 * (5 * out_features * in_features + in_features * in_features)

    def solve(
        self, quantizer: CalibratedQuantizer, weight: torch.Tensor, backend: Backend
    ) -> tuple[QuantizedWeight, Mapping[str, Any]]:
        assert isinstance(quantizer, HessianOnly)
        scheme = quantizer.scheme
        hessian, tokens = quantizer.accumulator.raw_sum()
        options = self.options
        qweight = quantize_weight_hessian_clip(
            weight, hessian, scheme.bits, scheme.sym, scheme.group_size, quantizer.name,
            options.clip_grid, options.clip_maxshrink,
        )  # fmt: skip
        return qweight, {"tokens": tokens}
