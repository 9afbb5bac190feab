"""The YAML entry of ``group`` (msModelSlim's ``configs`` field)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from msquant.plugin import ProcessorConfig, ProcessorConfigList


class GroupConfig(ProcessorConfig):
    """Config of ``group``: the processors applied together to each decoder layer."""

    type: Literal["group"] = "group"
    configs: ProcessorConfigList = Field(
        ...,
        description=(
            "The processor entries of the group, each a spec.process entry (any registered "
            "processor, a group too); they act on each decoder layer together, in this order, "
            "over one flow of the calibration data. A smoothing processor (iter_smooth, "
            "flex_smooth_quant, smooth_quant) beside linear_quant in one group is refused: "
            "msModelSlim 26.1.0 smooths nothing there; list the smoothing before the group."
        ),
    )
