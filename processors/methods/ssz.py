"""``method: ssz``: msModelSlim's SSZ weight quantization (round-to-nearest under per-channel
scales found by an alternating least-squares search, :mod:`.ssz_search`).

As in msModelSlim 26.1.0, ``ssz`` is symmetric per-channel int8 / int4 and needs no calibration
data. Its ``ext`` takes ``step`` (search steps, default 50) and accepts ``group_size``, which
msModelSlim's W4A8 best practices write beside ``scope: per_channel`` and which is ignored there
(with a warning), as it is by msModelSlim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from pydantic import Field, StrictInt

from msquant.plugin import (
    BaseScheme,
    ConfigIssue,
    DynamicRule,
    MethodOptions,
    QDType,
    QScope,
    QuantizationError,
    QuantizedWeight,
    QuantMethod,
    ResolvedScheme,
)
from msquant.plugin.numerics import check_weight
from msquant.processors.methods.options import GroupSize
from msquant.processors.methods.ssz_search import DEFAULT_STEPS, MAX_STEPS, ssz_codes, ssz_scales

__all__ = ["SszExt", "SszMethod"]

Steps = Annotated[
    StrictInt,
    Field(
        ge=0,
        le=MAX_STEPS,
        description="At most this many search steps (least-squares scale, then rounding); 0 "
        f"means the default 50, as in msModelSlim (0 to {MAX_STEPS}).",
    ),
]


class SszExt(MethodOptions):
    """``ext`` options of ``method: ssz``."""

    step: Steps = DEFAULT_STEPS
    group_size: GroupSize = 128


class SszMethod(QuantMethod):
    """SSZ: each module's per-channel scales searched to minimise its weight's squared error."""

    name = "ssz"
    options_class = SszExt
    dtypes = frozenset({QDType.INT8, QDType.INT4})
    scopes = frozenset({QScope.PER_CHANNEL})
    summary = "round-to-nearest, per-channel scales searched by least squares (msModelSlim's SSZ)"
    rule_keys = ("bits",)
    options: SszExt

    @property
    def steps(self) -> int:
        """The search steps (``ext.step``; 0 means the default)."""
        return self.options.step or DEFAULT_STEPS

    def config_issues(self, rules: Sequence[DynamicRule]) -> list[ConfigIssue]:
        if self.weight.symmetric:
            return []
        return [
            ConfigIssue(
                "qconfig.weight.symmetric",
                "method ssz is symmetric only (msModelSlim registers it for int8 / int4 "
                "per_channel symmetric weights); set symmetric: true, or use method minmax for "
                "asymmetric weights",
            )
        ]

    def base_scheme(self) -> BaseScheme:
        return BaseScheme(bits=self.bits, group_size=None, sym=True)

    def work_bytes(self, out_features: int, in_features: int) -> int:
        """The search's float32 working copies: five of the weight (its transpose, the current
        and the next codes, two temporaries of a step)."""
        return 5 * out_features * in_features * 4

    def quantize_rtn(
        self, weight: torch.Tensor, scheme: ResolvedScheme, name: str
    ) -> QuantizedWeight:
        if not scheme.sym or scheme.group_size is not None:
            raise QuantizationError(
                f"{name}: method ssz is symmetric per-channel only, got {scheme.describe()} "
                f"(decided by {scheme.decided_by})"
            )
        check_weight(weight, name, None)
        scale = ssz_scales(weight, scheme.bits, self.steps)
        codes = ssz_codes(weight.float().t(), scale, scheme.bits).t().to(torch.int8).contiguous()
        column = scale.reshape(-1, 1).contiguous()
        return QuantizedWeight(codes, column, torch.zeros_like(column), scheme.bits, True, None)
