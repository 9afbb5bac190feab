"""Packing one quantized linear into compressed-tensors ``pack-quantized`` tensors (pure).

Per quantized linear ``P``: ``P.weight_packed`` int32 ``[out, ceil(in * b / 32)]`` (unsigned codes
``q + 2^(b-1)`` packed densely along the input dimension, least significant bits first),
``P.weight_scale`` ``[out, G]`` in the dtype of the float weight it replaced, ``P.weight_shape``
int64 ``[out, in]``, asymmetric only ``P.weight_zero_point`` int32 ``[ceil(out * b / 32), G]``
(packed along the output dimension), and ``P.bias`` in the scale's dtype.
"""

from __future__ import annotations

import torch

from msquant.plugin import QuantizationError, QuantizedWeight, pack_int32

__all__ = ["MIN_BITS", "MAX_BITS", "pack_quantized_tensors"]

MIN_BITS, MAX_BITS = 2, 8


def _checked_scale(name: str, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` cast to ``dtype``, refusing values that overflow or flush to zero there."""
    cast = scale.to(dtype)
    lost = ~torch.isfinite(cast) | ((cast == 0) & (scale != 0))
    if bool(lost.any()):
        bad = scale[lost]
        raise QuantizationError(
            f"{name}: {int(lost.sum())} weight scale(s) (e.g. {float(bad[0]):.3g}) are not "
            f"representable in the model dtype {dtype} that compressed-tensors stores scales in; "
            "exclude this layer or export from a float32 / bfloat16 copy of the model"
        )
    return cast


def pack_quantized_tensors(
    name: str, qweight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The ``pack-quantized`` tensors of one quantized linear ``name`` (pure; inputs unchanged).

    :param dtype: the float dtype of the weight this linear replaced (scales and bias use it).
    :raises QuantizationError: for a bit width outside 2-8, scales not representable in ``dtype``,
        or zero points that are not integers in the code range.
    """
    bits = qweight.bits
    if not MIN_BITS <= bits <= MAX_BITS:
        raise QuantizationError(
            f"{name}: compressed-tensors pack-quantized stores {MIN_BITS}-{MAX_BITS} bit weights, "
            f"got int{bits}"
        )
    tensors = {
        f"{name}.weight_packed": pack_int32(qweight.unsigned_codes(), bits, dim=1),
        f"{name}.weight_scale": _checked_scale(name, qweight.scale, dtype),
        f"{name}.weight_shape": torch.tensor(qweight.shape, dtype=torch.int64),
    }
    if not qweight.symmetric:
        try:
            zero_points = qweight.unsigned_zero_points()
        except ValueError as exc:
            raise QuantizationError(f"{name}: {exc}") from exc
        tensors[f"{name}.weight_zero_point"] = pack_int32(zero_points, bits, dim=0)
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to(dtype)
    return tensors
