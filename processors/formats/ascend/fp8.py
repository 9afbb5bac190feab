"""The W8A8 fp8 layer type of the Ascend format (msModelSlim 26.1.0's ``ascendv1`` saver,
``on_wfp8afp8_dynamic_per_channel``): packing a quantized linear and decoding it back (pure).

Per linear ``P`` of type ``WFP8AFP8_DYNAMIC`` (fp8_e4m3 per-channel weights, fp8_e4m3 per-token
dynamic activations; nothing about the activations is stored):

* ``P.weight``: ``float8_e4m3fn`` ``[out, in]``, the elements;
* ``P.weight_scale``: float32 ``[out, 1]`` (``amax / 448`` of the channel);
* ``P.weight_offset``: float32 zeros ``[out, 1]``;
* ``P.bias`` float32, typed ``FLOAT``.

vLLM-Ascend 0.30 registers this layer as ``W8A8FP8_DYNAMIC`` (``methods/w8a8/w8a8fp8_dynamic.py``)
and has no scheme named ``WFP8AFP8_DYNAMIC``: it refuses msModelSlim's (and this) export of the
type by name (docs/formats.md); its compressed-tensors path loads the same layer from msquant's
``compressed_tensors`` export.
"""

from __future__ import annotations

import torch

from msquant.plugin import DecodedLayer, QuantizedLinear
from msquant.plugin.numerics import value_type_named

__all__ = ["FP8_PARTS", "FP8_TYPE", "FP8_VALUES", "decode_fp8", "fp8_module_tensors"]

#: msModelSlim's description type of a W8A8 fp8 linear.
FP8_TYPE = "WFP8AFP8_DYNAMIC"
#: Its weight and activation value types.
FP8_VALUES = ("fp8_e4m3", "fp8_e4m3")
#: The stored tensors of such a linear (the bias aside).
FP8_PARTS = ("weight", "weight_scale", "weight_offset")


def fp8_module_tensors(name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
    """The stored tensors of the W8A8 fp8 linear ``name`` (module docstring)."""
    scale = module.weight_scale.detach().to(torch.float32).reshape(-1, 1)
    tensors = {
        f"{name}.weight": module.weight.view(torch.float8_e4m3fn),
        f"{name}.weight_scale": scale,
        f"{name}.weight_offset": torch.zeros_like(scale),
    }
    if module.bias is not None:
        tensors[f"{name}.bias"] = module.bias.detach().float()
    return tensors


def decode_fp8(
    name: str, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> DecodedLayer | str:
    """The decoded W8A8 fp8 linear ``name`` from its stored tensors, or what is wrong with them."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        return (
            f"{name}.weight: {FP8_TYPE} stores float8_e4m3fn [out, in], got {weight.dtype} "
            f"{list(weight.shape)}"
        )
    out_features = int(weight.shape[0])
    for leaf, tensor in (("weight_scale", scale), ("weight_offset", offset)):
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (out_features, 1):
            return (
                f"{name}.{leaf}: {FP8_TYPE} stores float32 [{out_features}, 1], got "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
    if bool((offset != 0).any()):
        return f"{name}.weight_offset: {FP8_TYPE} is symmetric, the offset must be 0"
    return DecodedLayer.symmetric_per_channel(
        name,
        FP8_TYPE,
        weight.view(torch.uint8),
        scale,
        scale_dtype=torch.float32,
        tensors=(f"{name}.weight", f"{name}.weight_scale", f"{name}.weight_offset"),
        value_type=value_type_named(FP8_VALUES[0]),
    )
