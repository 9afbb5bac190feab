"""Round-to-nearest ("minmax") weight quantization of one 2-D weight."""

from __future__ import annotations

import torch

from msquant.errors import QuantizationError
from msquant.quant.finite import all_finite, non_finite_count
from msquant.quant.int_quant import quantize
from msquant.quant.mse_clip import MSEOptions, weight_qparams
from msquant.quant.quantized_weight import QuantizedWeight

__all__ = ["check_weight", "quantize_weight_minmax"]


def check_weight(weight: torch.Tensor, name: str, group_size: int | None) -> None:
    """Reject weights that cannot be quantized: not 2-D, not floating, non-finite, bad group size.

    :param name: the module name, used in messages.
    :raises QuantizationError: naming the module, its shape and the valid choices.
    """
    shape = tuple(weight.shape)
    if weight.dim() != 2:
        raise QuantizationError(
            f"{name}: weight must be 2-D [out, in] to be quantized, got shape {shape}"
        )
    if not weight.is_floating_point():
        raise QuantizationError(f"{name}: weight must be floating point, got {weight.dtype}")
    if group_size is not None:
        in_features = shape[1]
        if group_size <= 0 or in_features % group_size != 0:
            raise QuantizationError(
                f"{name}: group_size {group_size} does not divide in_features {in_features} "
                f"(weight shape {shape}); valid group sizes: {divisors(in_features)}"
            )
    if not all_finite(weight):
        bad = non_finite_count(weight)
        raise QuantizationError(
            f"{name}: weight {shape} contains {bad} NaN/Inf value(s); fix the checkpoint before quantizing"
        )


def divisors(n: int, limit: int = 24) -> str:
    """Human-readable list of the divisors of ``n`` (at most ``limit`` of them, largest last)."""
    found = [d for d in range(1, n + 1) if n % d == 0]
    if len(found) > limit:
        found = found[: limit // 2] + found[-limit // 2 :]
        return (
            ", ".join(map(str, found[: limit // 2]))
            + ", ..., "
            + ", ".join(map(str, found[limit // 2 :]))
        )
    return ", ".join(map(str, found))


def quantize_weight_minmax(
    weight: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None = None,
    name: str = "weight",
    mse: MSEOptions | None = None,
    full_range: bool = False,
) -> QuantizedWeight:
    """Quantize a 2-D weight by round-to-nearest with min/max-derived parameters.

    :param weight: ``[out, in]`` float tensor of any floating dtype (solved in float32).
    :param bits: bit width of the signed codes.
    :param symmetric: symmetric (zero offset) or asymmetric parameters.
    :param group_size: group width over input columns; ``None`` for per-channel.
    :param name: module name for error messages.
    :param mse: MSE clipping search options (:mod:`msquant.quant.mse_clip`); None (default) for
        plain min/max parameters, msModelSlim's numerics.
    :param full_range: symmetric scales ``max|w| / (2^(b-1) - 0.5)`` using the code ``-2^(b-1)``
        (GPTQModel / llm-compressor) instead of msModelSlim's ``/ (2^(b-1) - 1)``.
    """
    check_weight(weight, name, group_size)
    scale, offset = weight_qparams(weight, bits, symmetric, group_size, mse, full_range)
    codes = quantize(weight, scale, offset, bits, group_size)
    return QuantizedWeight(codes, scale, offset, bits, symmetric, group_size)
