"""The ``qconfig`` schema of msModelSlim's ``linear_quant``: data types, scopes and per-tensor configs.

Field names and enum values follow msModelSlim v1 (``ir/qal/qbase.py``) so existing YAML files
validate unchanged. Where msModelSlim's code makes a field required but its documentation states a
default (scope ``per_channel``, dtype ``int8``, symmetric ``true``), the documented default is used.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from msquant.quant.value_types import VALUE_TYPES, ValueType

__all__ = ["QDType", "QScope", "WeightQConfig", "ActQConfig", "LinearQConfig"]


class QDType(str, Enum):
    """Quantized data types known to the msModelSlim v1 schema (not all are implemented)."""

    FLOAT = "float"
    INT8 = "int8"
    INT4 = "int4"
    MXFP8 = "mxfp8"
    MXFP4 = "mxfp4"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def value_type(self) -> ValueType:
        """The value type of a quantized dtype (:mod:`msquant.quant.value_types`).

        :raises ValueError: for ``float`` and dtypes without a value type yet (``fp8_e4m3``).
        """
        if self.value not in VALUE_TYPES:
            raise ValueError(f"{self.value} has no quantized value type in msquant")
        return VALUE_TYPES[self.value]

    @property
    def self_scaled(self) -> bool:
        """Whether the dtype's value type computes its own scales (the MX block types, which
        go with ``scope: per_block``)."""
        return self.value in VALUE_TYPES and VALUE_TYPES[self.value].self_scaled

    @property
    def bits(self) -> int:
        """Code width of a quantized type (8 for int8 and mxfp8, 4 for int4 and mxfp4); raises
        for types without a value type."""
        return self.value_type.bits


class QScope(str, Enum):
    """Granularities known to the msModelSlim v1 schema (not all are implemented)."""

    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"
    PER_GROUP = "per_group"
    PER_BLOCK = "per_block"
    PER_TOKEN = "per_token"
    PD_MIX = "pd_mix"
    PER_HEAD = "per_head"
    DUAL_SCALE = "dual_scale"


class WeightQConfig(BaseModel):
    """How the weights of the matched linear layers are quantized (``qconfig.weight``).

    The common fields; ``qconfig.weight`` itself is a union of one subclass per registered method,
    discriminated on ``method``, each narrowing ``ext`` to that method's typed options (see
    :meth:`msquant.contracts.method.MethodRegistry.weight_config_type`).
    """

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    dtype: QDType = Field(QDType.INT8, description="Quantized data type.")
    scope: QScope = Field(QScope.PER_CHANNEL, description="Granularity of scales and offsets.")
    symmetric: bool = Field(True, description="Symmetric (offset 0) or asymmetric quantization.")
    method: str = Field(description="Algorithm computing the quantized weights.")
    ext: BaseModel = Field(
        description="Method-specific options, e.g. percdamp, block_size, group_size."
    )


class ActQConfig(BaseModel):
    """How activations are quantized (``qconfig.act``): float (the default, weight-only), or
    int8 ``per_tensor`` (static, W8A8) / ``per_token`` (dynamic, W8A8_DYNAMIC) with method
    ``minmax``, or ``mxfp8`` / ``mxfp4`` ``per_block`` (dynamic MX blocks of 32, ``ext: {axes:
    -1}``); which combinations a processor implements, it checks (``linear_quant``)."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    dtype: QDType = Field(QDType.FLOAT, description="float = activations stay unquantized.")
    scope: QScope = Field(QScope.PER_TENSOR, description="Granularity (ignored for float).")
    symmetric: bool = Field(True, description="Symmetry (ignored for float).")
    method: str = Field("none", description="Activation observer (none for float).")
    ext: dict[str, Any] = Field(default_factory=dict, description="Method-specific options.")


class LinearQConfig(BaseModel):
    """``qconfig`` of ``linear_quant``: weights are required, activations default to float."""

    model_config = ConfigDict(extra="forbid")

    act: ActQConfig = Field(default_factory=ActQConfig)
    weight: WeightQConfig
