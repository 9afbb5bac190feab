"""Packing one quantized linear into the Ascend format's tensors (pure functions).

Per quantized linear ``P``: ``P.weight`` int8 ``[out, in]`` (W8A16) or int8 ``[out, in/2]`` holding
two signed int4 codes per byte along the input dimension (W4A16: column ``2i`` in the low nibble,
``2i+1`` in the high nibble, as msModelSlim packs int4); ``P.weight_scale`` and
``P.weight_offset`` float32 ``[out, 1]`` (per-channel) or ``[out, in/group_size]``; ``P.bias``
float32 (``FLOAT``). Dequantization: ``w = (weight - weight_offset) * weight_scale``.

With quantized activations (``module.act``), msModelSlim's W8A8 family (docs/ascend-format.md,
"Activation schemes"; established on msModelSlim 26.1.0's exports by ``tests/oracle``):

* ``W8A8`` (static per-tensor activations): ``P.weight`` int8 ``[out, in]``, ``P.input_scale`` and
  ``P.input_offset`` float32 ``[1]``, ``P.deq_scale`` ``[out]`` (``input_scale * weight_scale``;
  float32 for bf16 models, else int64 holding the float32's bits), ``P.quant_bias`` int32
  ``[out]`` (``-input_offset * sum_j weight[i, j]``); no ``weight_scale`` / ``weight_offset``;
* ``W8A8_MIX`` (``scope: pd_mix``: static per-tensor activations in decode, per-token in
  prefill): the W8A8 tensors in the same order, then ``P.weight_scale`` and ``P.weight_offset``
  float32 ``[out, 1]`` (offset 0) for the prefill path, as msModelSlim 26.1.0 writes them;
* ``W8A8_DYNAMIC`` (per-token activations): ``P.weight``, ``P.weight_scale``, ``P.weight_offset``
  as for W8A16 (per-channel, offset 0);
* ``W4A8_DYNAMIC`` (per-token activations, int4 per-channel weights): ``P.weight`` int8
  ``[out / 2, in]``, the int4 codes packed in pairs of rows (row ``2i`` in the low nibble, ``2i + 1``
  in the high one), ``P.weight_scale`` / ``P.weight_offset`` float32 ``[out, 1]``, ``P.scale_bias``
  float32 ``[out, 1]``, or ``[out, 16]`` for the row-parallel layers (``o_proj``, ``down_proj``):
  8 times the sum of the dequantized weights over the row or each of its 16 slices;
* the float bias beside them in the model's dtype, ``P.bias`` (``FLOAT``), not folded in.

MX layers (``W8A8_MXFP8``, ``W4A4_MXFP4``, ``W4A8_MXFP``): :mod:`.mx`.
"""

from __future__ import annotations

import torch

from msquant.plugin import ActivationQuant, QuantizationError, QuantizedLinear
from msquant.plugin.export import pack_int4_pairs
from msquant.plugin.numerics import (
    deq_scale,
    encode_deq_scale,
    pack_int4_rows,
    quant_bias,
    scale_bias,
)
from msquant.processors.formats.ascend.fp8 import FP8_TYPE, FP8_VALUES, fp8_module_tensors
from msquant.processors.formats.ascend.mx import MX_TYPES, mx_module_tensors

__all__ = [
    "QUANT_TYPES_BY_BITS",
    "FLOAT",
    "quant_type",
    "ascend_module_tensors",
    "activation_module_tensors",
    "ROW_PARALLEL",
    "SCALE_BIAS_SLICES",
    "scale_bias_slices",
]

#: Layers vLLM shards by input features (RowParallelLinear): their W4A8 ``scale_bias`` is sliced.
ROW_PARALLEL = ("o_proj", "down_proj")
#: Slices of a row-parallel layer's ``scale_bias`` (msModelSlim's, vLLM-Ascend's ``[hidden, 16]``).
SCALE_BIAS_SLICES = 16


def scale_bias_slices(name: str) -> int:
    """How many slices of the input features ``name``'s W4A8 ``scale_bias`` holds."""
    return SCALE_BIAS_SLICES if name.rpartition(".")[2] in ROW_PARALLEL else 1


QUANT_TYPES_BY_BITS = {8: "W8A16", 4: "W4A16"}
FLOAT = "FLOAT"


def quant_type(module: QuantizedLinear, name: str) -> str:
    """``W8A16`` or ``W4A16`` from the module's bit width, ``W8A8`` / ``W8A8_DYNAMIC`` with
    quantized activations; other widths have no Ascend type.

    :raises QuantizationError: naming the module and the format that stores other widths.
    """
    if module.act is not None and module.act.value_type is not None:
        if module.act.scope == "per_token":
            return _fp8_type(module, module.act, name)
        return _mx_type(module, module.act, name)
    if module.value_type.family != "int":
        raise QuantizationError(
            f"{name}: {module.value_type.name} weights with float activations have no Ascend type"
        )
    if module.act is not None:
        int4_dynamic = module.bits == 4 and module.act.dynamic
        if (
            (module.bits != 8 and not int4_dynamic)
            or module.group_size is not None
            or not module.symmetric
        ):
            raise QuantizationError(
                f"{name}: the Ascend format stores quantized activations with per-channel "
                f"symmetric weights only (int8: W8A8, W8A8_MIX, W8A8_DYNAMIC; int4: W4A8_DYNAMIC), got "
                f"int{module.bits} {'per-channel' if module.group_size is None else 'per-group'} "
                f"{'sym' if module.symmetric else 'asym'}"
            )
        if int4_dynamic:
            return "W4A8_DYNAMIC"
        if module.act.scope == "pd_mix":
            return "W8A8_MIX"
        return "W8A8_DYNAMIC" if module.act.dynamic else "W8A8"
    found = QUANT_TYPES_BY_BITS.get(module.bits)
    if found is None:
        raise QuantizationError(
            f"{name}: the Ascend format has no weight-only type for int{module.bits}; valid: int8 "
            "(W8A16) and int4 (W4A16). Export other widths with type: compressed_tensors"
        )
    return found


def _fp8_type(module: QuantizedLinear, act: ActivationQuant, name: str) -> str:
    """``WFP8AFP8_DYNAMIC`` for fp8_e4m3 per-channel weights with fp8_e4m3 per-token activations.

    :raises QuantizationError: for other weights with float per-token activations.
    """
    if (module.value_type.name, act.value_type) != FP8_VALUES or module.group_size is not None:
        raise QuantizationError(
            f"{name}: {module.value_type.describe(module.group_size, module.symmetric)} weights "
            f"with {act.value_type} per-token activations have no Ascend type; valid: {FP8_TYPE} "
            "(fp8_e4m3 per-channel weights, fp8_e4m3 per-token act)"
        )
    return FP8_TYPE


def _mx_type(module: QuantizedLinear, act: ActivationQuant, name: str) -> str:
    """The MX type of a layer with MX activations (msModelSlim's layer for the pair).

    :raises QuantizationError: for a (weight, activation) pair without an MX type.
    """
    kind = act.scheme_name(module.bits)
    if MX_TYPES.get(kind) != (module.value_type.name, act.value_type):
        raise QuantizationError(
            f"{name}: {module.value_type.name} weights with {act.value_type} activations have no "
            f"Ascend type; valid: {', '.join(f'{t} ({w} weights, {a} act)' for t, (w, a) in MX_TYPES.items())}"
        )
    return kind


def ascend_module_tensors(
    name: str, module: QuantizedLinear, model_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The stored tensors of the quantized linear ``name``, in the order they are written.

    :param model_dtype: the model's floating dtype (sets W8A8's ``deq_scale`` encoding).
    :raises QuantizationError: for a width without an Ascend type, or W4A16 with an odd
        ``in_features`` (two codes per byte).
    """
    kind = quant_type(module, name)
    if kind in MX_TYPES:
        return mx_module_tensors(name, module, kind)
    if kind == FP8_TYPE:
        return fp8_module_tensors(name, module)
    if module.act is not None:
        return activation_module_tensors(name, module, kind, model_dtype)
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


def activation_module_tensors(
    name: str, module: QuantizedLinear, kind: str, model_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The W8A8 / W8A8_DYNAMIC tensors of the quantized linear ``name`` (module docstring)."""
    act = module.act
    assert act is not None
    tensors = {f"{name}.weight": module.weight}
    if kind == "W4A8_DYNAMIC":
        out_features, in_features = module.weight.shape
        slices = scale_bias_slices(name)
        if out_features % 2 or in_features % slices:
            raise QuantizationError(
                f"{name}: W4A8_DYNAMIC packs int4 codes in pairs of rows and slices the "
                f"scale_bias of row-parallel layers in {SCALE_BIAS_SLICES}: out_features "
                f"{out_features} must be even and in_features {in_features} divisible by {slices}; "
                "exclude this layer"
            )
        tensors[f"{name}.weight"] = pack_int4_rows(module.weight)
    if kind in ("W8A8", "W8A8_MIX"):
        assert act.scale is not None and act.offset is not None
        tensors[f"{name}.input_scale"] = torch.tensor([act.scale], dtype=torch.float32)
        tensors[f"{name}.input_offset"] = torch.tensor([act.offset], dtype=torch.float32)
        deq = deq_scale(act.scale, module.weight_scale)
        tensors[f"{name}.deq_scale"] = encode_deq_scale(deq, model_dtype)
        tensors[f"{name}.quant_bias"] = quant_bias(module.weight, act.offset)
    if kind != "W8A8":
        tensors[f"{name}.weight_scale"] = module.weight_scale
        tensors[f"{name}.weight_offset"] = module.weight_offset
    if kind == "W4A8_DYNAMIC":
        slices = scale_bias_slices(name)
        tensors[f"{name}.scale_bias"] = scale_bias(module.weight, module.weight_scale, slices)
    if module.bias is not None:
        tensors[f"{name}.bias"] = module.bias.detach()
    return tensors
