"""Reference computations of the two CUDA / Triton ops SGLang 0.5.23's int8 W8A8 linear scheme
calls, so that its own Python (``CompressedTensorsW8A8Int8``'s weight processing and
``apply_weights``) runs on the CPU.

What each op computes is read from the wheel: ``per_token_quant_int8``
(``sglang/kernels/ops/quantization/int8_kernel.py``, the Triton kernel ``_per_token_quant_int8``:
``absmax = max(max|x|, 1e-10)`` per row, scale ``absmax / 127``, codes ``round(x * 127 / absmax)``
with CUDA's ``roundf``, halves away from zero) and ``sgl_kernel.int8_scaled_mm`` (its fake
implementation in ``layers/quantization/w8a8_int8.py`` and its use there: ``[M, K]`` int8 codes
times the transposed ``[K, N]`` int8 weight, scaled per row by ``scales_a`` and per column by
``scales_b``, plus the bias). Only these formulas are stand-ins: which op is called with which
tensors is SGLang's code.
"""

from __future__ import annotations

import torch

__all__ = ["PER_TOKEN_CALLS", "int8_scaled_mm", "per_token_quant_int8"]

#: Inputs ``per_token_quant_int8`` was called with, in order (what SGLang quantized per token).
PER_TOKEN_CALLS: list[torch.Tensor] = []


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def per_token_quant_int8(
    x: torch.Tensor, scale_dtype: torch.dtype = torch.float32, cal_sum: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of each row of ``x`` and the rows' scales ``[..., 1]``."""
    if cal_sum:
        raise NotImplementedError("cal_sum is not used by CompressedTensorsW8A8Int8")
    PER_TOKEN_CALLS.append(x)
    values = x.to(torch.float32)
    absmax = values.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    codes = _round_half_away(values * (127.0 / absmax)).clamp(-128, 127)
    return codes.to(torch.int8), (absmax / 127.0).to(scale_dtype)


def int8_scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scales_a: torch.Tensor,
    scales_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scales_a * (A @ B) * scales_b^T + bias`` with integer accumulation (``A`` int8
    ``[M, K]``, ``B`` int8 ``[K, N]``, ``scales_a`` ``[M, 1]``, ``scales_b`` ``[N, 1]`` or one)."""
    accumulated = (mat_a.to(torch.int64) @ mat_b.to(torch.int64)).to(torch.float32)
    out = accumulated * scales_a.to(torch.float32).reshape(-1, 1)
    out = out * scales_b.to(torch.float32).reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
