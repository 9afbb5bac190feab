"""Decoding of the Ascend export's activation-quantized layers (W8A8, W4A8_DYNAMIC).

Split from :mod:`~msquant.processors.formats.ascend.reader` (which decodes the weight-only types
and owns the description and tensor store): these layer types store derived tensors beside the
weights (``deq_scale``, ``quant_bias``, ``scale_bias``) that are checked exactly against the codes
here, and recover the weight scale the weight-only types store directly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from msquant.plugin import DecodedLayer
from msquant.plugin.numerics import (
    decode_deq_scale,
    deq_scale,
    quant_bias,
    scale_bias,
    unpack_int4_rows,
)
from msquant.plugin.reading import trivial_g_idx
from msquant.processors.formats.ascend.layer_types import TYPE_PARTS, W8A8_PARTS

if TYPE_CHECKING:
    from msquant.processors.formats.ascend.reader import AscendReader

__all__ = ["decode_w4a8", "decode_w8a8"]


def decode_w8a8(reader: AscendReader, module: str, kind: str = "W8A8") -> DecodedLayer | None:
    """A W8A8 (static activations) layer: the activation parameters and the derived tensors
    checked, the weight scale recovered as ``deq_scale / input_scale``. A W8A8_MIX layer (pd_mix)
    stores the weight scale too (``[out, 1]``, offset 0, for its prefill path): that one is
    decoded, and ``deq_scale`` checked to be ``input_scale * weight_scale`` exactly."""
    names = {part: f"{module}.{part}" for part in W8A8_PARTS}
    if reader.store is None or not reader.expect(names["weight"], (torch.int8,), None):
        return None
    weight_shape = reader.store.infos[names["weight"]].shape
    if len(weight_shape) != 2:
        reader.findings.error(f"{names['weight']}: shape {list(weight_shape)}, expected [out, in]")
        return None
    out_features = weight_shape[0]
    bf16 = reader.model_dtype() == "bfloat16"
    deq_dtype = torch.float32 if bf16 else torch.int64
    checks = [
        reader.expect(names["input_scale"], (torch.float32,), (1,)),
        reader.expect(names["input_offset"], (torch.float32,), (1,)),
        reader.expect(names["deq_scale"], (torch.float32, torch.int64), (out_features,)),
        reader.expect(names["quant_bias"], (torch.int32,), (out_features,)),
    ]
    if kind == "W8A8_MIX":
        checks += [
            reader.expect(f"{module}.{part}", (torch.float32,), (out_features, 1))
            for part in ("weight_scale", "weight_offset")
        ]
    if not all(checks):
        return None
    deq = reader.store.get(names["deq_scale"])
    if deq.dtype != deq_dtype:
        reader.findings.error(
            f"{names['deq_scale']}: {str(deq.dtype).replace('torch.', '')}, but the model is "
            f"{reader.model_dtype() or 'not bfloat16'}: vLLM-Ascend's W8A8 scheme creates it "
            f"{'float32 for bf16 models' if bf16 else 'int64 (float32 bits) for fp16 models'}"
        )
        return None
    input_scale = float(reader.store.get(names["input_scale"])[0])
    input_offset = float(reader.store.get(names["input_offset"])[0])
    if not input_scale > 0 or input_offset != round(input_offset) or abs(input_offset) > 128:
        reader.findings.error(
            f"{names['input_scale']} / {names['input_offset']}: {input_scale} / {input_offset}; "
            "expected a positive scale and an integral int8 zero point"
        )
        return None
    try:
        deq_float = decode_deq_scale(deq)
    except ValueError as error:
        reader.findings.error(f"{names['deq_scale']}: {error}")
        return None
    codes = reader.store.get(names["weight"])
    stored_bias = reader.store.get(names["quant_bias"])
    expected_bias = quant_bias(codes, input_offset)
    if not torch.equal(stored_bias, expected_bias):
        count = int((stored_bias != expected_bias).sum())
        reader.findings.error(
            f"{names['quant_bias']}: {count} value(s) differ from -input_offset * sum of the "
            "weight codes of their row"
        )
    scale = (deq_float.double() / input_scale).to(torch.float32).reshape(out_features, 1)
    scale_name = f"{names['deq_scale']} / {names['input_scale']}"
    if kind == "W8A8_MIX":
        scale, scale_name = reader.store.get(f"{module}.weight_scale"), f"{module}.weight_scale"
        if reader.store.get(f"{module}.weight_offset").any():
            reader.findings.error(
                f"{module}.weight_offset: not zero (W8A8_MIX weights are symmetric)"
            )
        if not torch.equal(deq_float, deq_scale(input_scale, scale)):
            reader.findings.error(
                f"{names['deq_scale']}: differs from input_scale * weight_scale (float32)"
            )
    return DecodedLayer.symmetric_per_channel(
        module,
        kind,
        codes.to(torch.int32),
        scale,
        scale_dtype=torch.float32,
        tensors=(names["weight"], scale_name, f"{module} (symmetric weights: zero)"),
    )


def decode_w4a8(reader: AscendReader, module: str) -> DecodedLayer | None:
    """A W4A8_DYNAMIC layer: int4 codes unpacked from pairs of rows, ``scale_bias`` checked
    against them exactly."""
    names = {part: f"{module}.{part}" for part in TYPE_PARTS["W4A8_DYNAMIC"]}
    if reader.store is None or not reader.expect(names["weight"], (torch.int8,), None):
        return None
    rows, in_features = reader.store.infos[names["weight"]].shape
    out_features = rows * 2
    checks = [
        reader.expect(names["weight_scale"], (torch.float32,), (out_features, 1)),
        reader.expect(names["weight_offset"], (torch.float32,), (out_features, 1)),
        reader.expect(names["scale_bias"], (torch.float32,), None),
    ]
    if not all(checks):
        return None
    stored_bias = reader.store.get(names["scale_bias"])
    slices = stored_bias.shape[1] if stored_bias.dim() == 2 else 0
    if (
        stored_bias.dim() != 2
        or stored_bias.shape[0] != out_features
        or slices < 1
        or in_features % slices
    ):
        reader.findings.error(
            f"{names['scale_bias']}: shape {list(stored_bias.shape)}, expected "
            f"[{out_features}, 1] or [{out_features}, 16]"
        )
        return None
    codes = unpack_int4_rows(reader.store.get(names["weight"]))
    scale = reader.store.get(names["weight_scale"])
    if not torch.equal(stored_bias, scale_bias(codes, scale, slices)):
        reader.findings.error(
            f"{names['scale_bias']}: differs from 8 * the sum of the dequantized weights "
            f"over {slices} slice(s) of each row"
        )
    return DecodedLayer(
        name=module,
        scheme="W4A8_DYNAMIC",
        bits=4,
        group_size=None,
        codes=codes.to(torch.int32),
        scale=scale,
        offset=reader.store.get(names["weight_offset"]).to(torch.float32),
        g_idx=trivial_g_idx(in_features, in_features),
        scale_dtype=torch.float32,
        tensors={
            "codes": names["weight"],
            "scale": names["weight_scale"],
            "offset": names["weight_offset"],
            "g_idx": f"{module} (per-channel)",
        },
    )
