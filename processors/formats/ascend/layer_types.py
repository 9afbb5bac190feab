"""The Ascend export's layer types: the description's type names, their bit widths and the
tensors each stores per quantized linear (msModelSlim v1, ``shared/reference/msmodelslim.md``
section 7). Shared by the reader and the activation layers' decoding."""

from __future__ import annotations

from msquant.plugin.numerics import value_type_named
from msquant.processors.formats.ascend.fp8 import FP8_PARTS, FP8_TYPE
from msquant.processors.formats.ascend.mx import MX_PARTS, MX_TYPES

__all__ = [
    "FLOAT",
    "GLOBAL_KEYS",
    "PARAMETER_LEAVES",
    "PARTS",
    "TYPE_BITS",
    "TYPE_PARTS",
    "W8A8_PARTS",
    "W16A16S",
]

FLOAT = "FLOAT"  # the description type of a float tensor, also its scheme in the fused check
#: A pruned float linear (``float_sparse``): its ``weight`` and ``bias`` in the model's dtype,
#: zeros where pruned; read like FLOAT tensors.
W16A16S = "W16A16S"

GLOBAL_KEYS = ("version", "model_quant_type", "metadata", "group_size", "optional")
TYPE_BITS = {
    "W8A16": 8,
    "W4A16": 4,
    "W8A8_DYNAMIC": 8,
    "W8A8": 8,
    "W8A8_MIX": 8,
    "W4A8_DYNAMIC": 4,
    **{kind: value_type_named(weight).bits for kind, (weight, _) in MX_TYPES.items()},
    FP8_TYPE: 8,
}
PARTS = ("weight", "weight_scale", "weight_offset")
W8A8_PARTS = ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias")
#: The stored tensors of a quantized linear of each type (the bias aside).
TYPE_PARTS = {
    "W8A16": PARTS,
    "W4A16": PARTS,
    "W8A8_DYNAMIC": PARTS,
    "W8A8": W8A8_PARTS,
    "W8A8_MIX": (*W8A8_PARTS, "weight_scale", "weight_offset"),
    "W4A8_DYNAMIC": (*PARTS, "scale_bias"),
    # MX (:mod:`.mx`): float8 / packed float4 elements and E8M0 block exponents, no offset
    **dict.fromkeys(MX_TYPES, MX_PARTS),
    # W8A8 fp8 (:mod:`.fp8`): float8_e4m3fn weight, float32 per-channel scale, zero offset
    FP8_TYPE: FP8_PARTS,
}
#: Every tensor name ending that belongs to a quantized linear's parameters.
PARAMETER_LEAVES = tuple(dict.fromkeys(p for parts in TYPE_PARTS.values() for p in parts[1:]))
