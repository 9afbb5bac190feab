"""Packing one quantized linear into the Ascend format's tensors (pure functions).

Per quantized linear ``P``: ``P.weight`` int8 ``[out, in]`` (W8A16) or int8 ``[out, in/2]`` holding
two signed int4 codes per byte along the input dimension (W4A16: column ``2i`` in the low nibble,
``2i+1`` in the high nibble, as msModelSlim packs int4); ``P.weight_scale`` and
``P.weight_offset`` float32 ``[out, 1]`` (per-channel) or ``[out, in/group_size]``; ``P.bias``
float32 (``FLOAT``). Dequantization: ``w = (weight - weight_offset) * weight_scale``.
"""

from __future__ import annotations

import torch

from msquant import QuantizationError, QuantizedLinear, pack_int4_pairs

__all__ = ["QUANT_TYPES_BY_BITS", "FLOAT", "quant_type", "ascend_module_tensors"]

QUANT_TYPES_BY_BITS = {8: "W8A16", 4: "W4A16"}
FLOAT = "FLOAT"


def quant_type(module: QuantizedLinear, name: str) -> str:
    """``W8A16`` or ``W4A16`` from the module's bit width; other widths have no Ascend type.

    :raises QuantizationError: naming the module and the format that stores other widths.
    """
    found = QUANT_TYPES_BY_BITS.get(module.bits)
    if found is None:
        raise QuantizationError(
            f"{name}: the Ascend format has no weight-only type for int{module.bits}; valid: int8 "
            "(W8A16) and int4 (W4A16). Export other widths with type: compressed_tensors"
        )
    return found


def ascend_module_tensors(name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
    """The stored tensors of the quantized linear ``name``, in the order they are written.

    :raises QuantizationError: for a width without an Ascend type, or W4A16 with an odd
        ``in_features`` (two codes per byte).
    """
    kind = quant_type(module, name)
    weight = module.weight
    if kind == "W4A16":
        if weight.shape[1] % 2:
            raise QuantizationError(
                f"{name}: W4A16 packs two int4 codes per byte along in_features, "
                f"which is odd ({weight.shape[1]}); exclude this layer or use int8"
            )
        weight = pack_int4_pairs(weight)
    tensors = {
        f"{name}.weight": weight,
        f"{name}.weight_scale": module.weight_scale,
        f"{name}.weight_offset": module.weight_offset,
    }
    if module.bias is not None:
        tensors[f"{name}.bias"] = module.bias.float()
    return tensors
