"""The derived tensors of msModelSlim's W8A8-family Ascend exports (pure functions).

Established on msModelSlim 26.1.0's exports of tiny models (``tests/oracle``) and checked against
vLLM-Ascend's loading code (docs/ascend-format.md, "Activation schemes"):

* ``deq_scale`` (W8A8 static) ``= input_scale * weight_scale`` per output channel, float32 ``[out]``;
  written as float32 for bf16 models and otherwise (fp16, fp32) as int64 holding the float32's bit
  pattern (:func:`encode_deq_scale`), the two dtypes vLLM-Ascend's W8A8 scheme creates for bf16 and
  fp16 models;
* ``quant_bias`` (W8A8 static) ``= -input_offset * sum_j weight[i, j]`` as int32 ``[out]``: the
  correction for the activations' zero point, since
  ``W x ~ deq_scale * (sum_j q_w[i, j] * q_x[j] - input_offset * sum_j q_w[i, j])``. A float
  ``bias`` is not folded in; msModelSlim writes it beside, as ``P.bias``;
* ``scale_bias`` (W4A8_DYNAMIC) ``= 8 * sum_j weight_scale[i] * q_w[i, j]`` (8 times the sum of the
  dequantized float32 weights) over ``chunks`` equal slices of the input features (1 for
  column-parallel layers, 16 for ``o_proj`` / ``down_proj``);
* int4 weight codes are packed in pairs along the output dimension into int8 ``[out / 2, in]``:
  row ``2i`` in the low nibble, row ``2i + 1`` in the high nibble (:func:`pack_int4_rows`).
"""

from __future__ import annotations

import torch

__all__ = [
    "decode_deq_scale",
    "deq_scale",
    "encode_deq_scale",
    "pack_int4_rows",
    "quant_bias",
    "scale_bias",
    "unpack_int4_rows",
]


def deq_scale(input_scale: float, weight_scale: torch.Tensor) -> torch.Tensor:
    """``input_scale * weight_scale`` as float32 ``[out]`` (``weight_scale`` is ``[out]`` or ``[out, 1]``)."""
    return (weight_scale.float().reshape(-1) * torch.tensor(input_scale, dtype=torch.float32)).to(
        torch.float32
    )


def encode_deq_scale(deq: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """``deq_scale`` as stored: float32 for bf16 models, else int64 holding the float32 bits."""
    deq = deq.to(torch.float32).contiguous()
    if model_dtype == torch.bfloat16:
        return deq
    return deq.view(torch.int32).to(torch.int64)


def decode_deq_scale(stored: torch.Tensor) -> torch.Tensor:
    """The float32 ``deq_scale`` of a stored tensor (float32, or int64 holding float32 bits).

    :raises ValueError: for an int64 value outside the int32 range (not a float32 bit pattern).
    """
    if stored.dtype != torch.int64:
        return stored.to(torch.float32)
    low, high = -(2**31), 2**31 - 1
    if stored.numel() and (int(stored.min()) < low or int(stored.max()) > high):
        raise ValueError("int64 deq_scale holds values outside the int32 range: not float32 bits")
    return stored.to(torch.int32).view(torch.float32)


def quant_bias(weight_codes: torch.Tensor, input_offset: float) -> torch.Tensor:
    """``-input_offset * sum_j q[i, j]`` as int32 ``[out]`` (exact: integers)."""
    sums = weight_codes.to(torch.int64).sum(dim=1)
    return (-round(input_offset) * sums).to(torch.int32)


def scale_bias(weight_codes: torch.Tensor, weight_scale: torch.Tensor, chunks: int) -> torch.Tensor:
    """8 times the sum of the dequantized weights per slice of ``in / chunks`` input features,
    float32 ``[out, chunks]``, summed in float32 as msModelSlim does (bit-identical to its export;
    the sum of a slice can cancel to nearly 0, where another summation order differs relatively).

    :raises ValueError: when ``chunks`` does not divide the input features.
    """
    out_features, in_features = weight_codes.shape
    if chunks <= 0 or in_features % chunks:
        raise ValueError(f"chunks {chunks} must divide in_features {in_features}")
    dequantized = weight_codes.to(torch.float32) * weight_scale.to(torch.float32).reshape(-1, 1)
    return dequantized.reshape(out_features, chunks, -1).sum(dim=-1) * 8.0


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Pack int4 codes ``[out, in]`` (values in [-8, 7]) into int8 ``[out / 2, in]``: row ``2i``
    in the low nibble, row ``2i + 1`` in the high nibble.

    :raises ValueError: for an odd number of rows or a code outside [-8, 7].
    """
    if codes.shape[0] % 2:
        raise ValueError(f"int4 row packing needs an even number of rows, got {codes.shape[0]}")
    if codes.numel() and (int(codes.min()) < -8 or int(codes.max()) > 7):
        raise ValueError("int4 codes must lie in [-8, 7]")
    wide = codes.to(torch.int16)
    low, high = wide[0::2] & 0xF, (wide[1::2] & 0xF) << 4
    return ((low | high) - ((low | high) >= 128).to(torch.int16) * 256).to(torch.int8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_rows`: int8 ``[out / 2, in]`` -> int8 codes ``[out, in]``."""
    wide = packed.to(torch.int16)
    low = ((wide & 0xF) ^ 8) - 8
    high = (((wide >> 4) & 0xF) ^ 8) - 8
    rows = torch.empty((packed.shape[0] * 2, packed.shape[1]), dtype=torch.int16)
    rows[0::2], rows[1::2] = low, high
    return rows.to(torch.int8)
