"""Packing one quantized linear into compressed-tensors ``pack-quantized`` tensors (pure).

Per quantized linear ``P``: ``P.weight_packed`` int32 ``[out, ceil(in * b / 32)]`` (unsigned codes
``q + 2^(b-1)`` packed densely along the input dimension, least significant bits first),
``P.weight_scale`` ``[out, G]`` in the dtype of the float weight it replaced, ``P.weight_shape``
int64 ``[out, in]``, asymmetric only ``P.weight_zero_point`` int32 ``[ceil(out * b / 32), G]``
(packed along the output dimension), and ``P.bias`` in the scale's dtype.

With int8 activations (W8A8, ``int-quantized``, the tensors vLLM's ``CompressedTensorsW8A8Int8``
creates and llm-compressor writes): ``P.weight`` int8 ``[out, in]`` (signed codes, symmetric
per-channel), ``P.weight_scale`` float32 ``[out, 1]``, for static activations ``P.input_scale``
float32 ``[1]`` and, asymmetric only, ``P.input_zero_point`` int8 ``[1]`` (the signed zero point:
``x ~ (q_x - zero_point) * input_scale``), and ``P.bias`` in the model dtype. Scales stay float32,
the dtype of vLLM's parameters, so nothing is rounded on the way.

MX (``mxfp8-quantized`` / ``mxfp4-pack-quantized``, what vLLM's ``CompressedTensorsW8A8Mxfp8`` /
``CompressedTensorsW4A4Mxfp4`` and compressed-tensors' MX compressors create and read): MXFP8
``P.weight`` ``float8_e4m3fn`` ``[out, in]`` (the elements), MXFP4 ``P.weight_packed`` uint8
``[out, in / 2]`` (two e2m1 codes per byte, element ``2i`` in the low nibble, the order of
compressed-tensors' ``unpack_fp4_from_uint8``), ``P.weight_scale`` uint8 ``[out, in / 32]`` (the
E8M0 byte ``e + 127`` of each block's scale ``2^e``), ``P.bias`` in the model dtype.
"""

from __future__ import annotations

import torch

from msquant.plugin import ActivationQuant, QuantizationError, QuantizedWeight
from msquant.plugin.export import pack_int32
from msquant.plugin.numerics import e8m0_bytes, pack_nibbles
from msquant.processors.formats.compressed_tensors.config import MX_FORMATS

__all__ = [
    "pack_float_quantized_tensors",
    "pack_mx_tensors",
    "MIN_BITS",
    "MAX_BITS",
    "W8A8_REFUSAL",
    "pack_int_quantized_tensors",
    "pack_quantized_tensors",
]

#: Why compressed-tensors refuses int4 weights with int8 activations (W4A8_DYNAMIC).
W8A8_REFUSAL = (
    "compressed_tensors stores int8 activations only with int8 per-channel symmetric weights "
    "(W8A8 / W8A8_DYNAMIC, vLLM's CompressedTensorsW8A8Int8); {found} is not: export "
    "W4A8_DYNAMIC with type: ascendv1_saver (msModelSlim's layout, served by vLLM-Ascend) or use "
    "int8 weights"
)

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


def pack_float_quantized_tensors(
    name: str, qweight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The ``float-quantized`` tensors of one FP8 W8A8 linear ``name`` (pure; inputs unchanged):
    ``weight`` ``float8_e4m3fn`` ``[out, in]``, ``weight_scale`` float32 ``[out, 1]`` (the dtype
    of vLLM's parameter), ``bias`` in the model dtype ``dtype``.

    :raises QuantizationError: for weights other than fp8_e4m3 per-channel.
    """
    if qweight.value_type.family != "fp8" or qweight.group_size is not None:
        raise QuantizationError(
            f"{name}: compressed-tensors float-quantized stores fp8_e4m3 per-channel weights, got "
            f"{qweight.value_type.describe(qweight.group_size, qweight.symmetric)}"
        )
    tensors = {
        f"{name}.weight": qweight.codes.to(torch.uint8).view(torch.float8_e4m3fn),
        f"{name}.weight_scale": qweight.scale.to(torch.float32).reshape(-1, 1),
    }
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to(dtype)
    return tensors


def pack_mx_tensors(
    name: str,
    qweight: QuantizedWeight,
    act: ActivationQuant | None,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The ``mxfp8-quantized`` / ``mxfp4-pack-quantized`` tensors of one MX linear ``name``
    (pure; inputs unchanged; module docstring).

    :param act: the layer's activation quantization: dynamic per block of the weight's own MX
        type (the config group describes it; nothing is stored for it).
    :param dtype: the float dtype of the weight this linear replaced (the bias uses it).
    :raises QuantizationError: for activations of another type (W4A8_MXFP: vLLM and vLLM-Ascend
        read no such compressed-tensors group as MXFP8 activations) or an odd ``in_features``.
    """
    values = qweight.value_type
    if values.name not in MX_FORMATS:
        raise QuantizationError(
            f"{name}: compressed-tensors has no format for {values.name} codes (it writes "
            f"{', '.join(f'{k} as {v}' for k, v in MX_FORMATS.items())}); export them with "
            "type: ascendv1_saver"
        )
    if act is None or act.value_type != values.name:
        found = "float" if act is None else str(act.value_type)
        raise QuantizationError(
            f"{name}: compressed-tensors MX groups store {values.name} weights with dynamic "
            f"{values.name} activations (vLLM's and vLLM-Ascend's MX schemes); got {found} "
            "activations: export them with type: ascendv1_saver"
        )
    codes = qweight.codes.to(torch.uint8)
    if values.name == "mxfp4":
        if codes.shape[1] % 2:
            raise QuantizationError(
                f"{name}: mxfp4-pack-quantized packs two codes per byte along in_features, "
                f"which is {codes.shape[1]}; exclude this layer"
            )
        tensors = {f"{name}.weight_packed": pack_nibbles(codes)}
    else:  # mxfp8: the e4m3 elements as they are
        tensors = {f"{name}.weight": codes.view(torch.float8_e4m3fn)}
    try:
        tensors[f"{name}.weight_scale"] = e8m0_bytes(qweight.scale)
    except ValueError as exc:
        raise QuantizationError(f"{name}: {exc}") from exc
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to(dtype)
    return tensors


def pack_int_quantized_tensors(
    name: str,
    qweight: QuantizedWeight,
    act: ActivationQuant,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The ``int-quantized`` tensors of one W8A8 linear ``name`` (pure; inputs unchanged).

    :param act: how the layer's input is quantized (per-token dynamic or calibrated per-tensor).
    :param dtype: the float dtype of the weight this linear replaced (the bias uses it).
    :raises QuantizationError: for weights other than int8 per-channel symmetric.
    """
    if qweight.bits != 8 or not qweight.symmetric or qweight.group_size is not None:
        scope = "per-channel" if qweight.group_size is None else f"group {qweight.group_size}"
        found = f"int{qweight.bits} {scope} {'sym' if qweight.symmetric else 'asym'}"
        raise QuantizationError(f"{name}: " + W8A8_REFUSAL.format(found=found))
    tensors = {
        f"{name}.weight": qweight.codes.to(torch.int8),
        f"{name}.weight_scale": qweight.scale.to(torch.float32).reshape(-1, 1),
    }
    if not act.dynamic:
        assert act.scale is not None and act.offset is not None
        tensors[f"{name}.input_scale"] = torch.tensor([act.scale], dtype=torch.float32)
        if not act.symmetric:
            tensors[f"{name}.input_zero_point"] = torch.tensor([act.offset], dtype=torch.int8)
    if bias is not None:
        tensors[f"{name}.bias"] = bias.detach().to(dtype)
    return tensors
