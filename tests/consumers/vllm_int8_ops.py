"""Reference computations of vLLM 0.33's int8 W8A8 CUDA ops, so that the CUTLASS int8 kernel's
own Python (weight processing after loading, ``apply_weights``) runs on the CPU.

What each op computes is taken from its documentation in the wheel (``vllm/_custom_ops.py``,
``csrc/quantization/w8a8/cutlass/Epilogues.md`` as the kernel's Python cites it) and the torch
reference the wheel carries for dynamic per-token quantization
(``quantization/utils/int8_utils.py``: ``scale = absmax / 127``, codes ``round(x * 127 /
absmax)``). Rounding is to nearest, ties to even (the CUDA kernels' ``nearbyint``). Only these
formulas are stand-ins: which op is called with which tensors is vLLM's code.
"""

from __future__ import annotations

import torch

__all__ = ["scaled_int8_quant", "cutlass_scaled_mm", "cutlass_scaled_mm_azp"]

INT8_MIN, INT8_MAX = -128, 127


def scaled_int8_quant(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    azp: torch.Tensor | None = None,
    symmetric: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Static per-tensor (``scale`` given: ``round(x / scale) + azp``, clamped) or dynamic
    per-token symmetric int8 quantization; returns ``(codes, scale, azp)``."""
    x = input.to(torch.float32)
    if scale is not None:
        assert symmetric == (azp is None), "azp must only be provided for asymmetric quantization"
        codes = torch.round(x / scale.to(torch.float32))
        if azp is not None:
            codes = codes + azp.to(torch.float32)
        return codes.clamp(INT8_MIN, INT8_MAX).to(torch.int8), scale, azp
    if not symmetric:
        raise NotImplementedError("dynamic asymmetric int8 quantization: not used by msquant")
    rows = x.reshape(-1, x.shape[-1])
    absmax = rows.abs().amax(dim=-1, keepdim=True)
    codes = torch.round(rows * (127.0 / absmax)).clamp(INT8_MIN, INT8_MAX)
    return codes.to(torch.int8).reshape(input.shape), absmax / 127.0, None


def _scaled(
    accumulated: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``scale_a * acc * scale_b^T (+ bias)``: ``scale_a`` per tensor or per row ``[M, 1]``,
    ``scale_b`` per tensor or per column ``[N, 1]``."""
    out = accumulated.to(torch.float32) * scale_a.to(torch.float32).reshape(-1, 1)
    out = out * scale_b.to(torch.float32).reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def cutlass_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``D = scale_a * (A @ B) * scale_b^T + bias`` with int32 accumulation (``A`` int8
    ``[M, K]``, ``B`` int8 ``[K, N]``)."""
    accumulated = a.reshape(-1, a.shape[-1]).to(torch.int64) @ b.to(torch.int64)
    out = _scaled(accumulated, scale_a, scale_b, out_dtype, bias)
    return out.reshape(*a.shape[:-1], b.shape[1])


def cutlass_scaled_mm_azp(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    azp_adj: torch.Tensor,
    azp: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Asymmetric activations: ``D = scale_a * (A @ B - azp_adj) * scale_b^T + bias`` for
    per-tensor ``azp`` folded into ``azp_adj`` (static), ``A @ B - azp * azp_adj`` per token
    otherwise (``azp_adj`` = the column sums of ``B``)."""
    rows = a.reshape(-1, a.shape[-1]).to(torch.int64)
    accumulated = rows @ b.to(torch.int64)
    adjust = azp_adj.to(torch.int64).reshape(1, -1)
    if azp is not None:
        adjust = azp.to(torch.int64).reshape(-1, 1) * adjust
    out = _scaled(accumulated - adjust, scale_a, scale_b, out_dtype, bias)
    return out.reshape(*a.shape[:-1], b.shape[1])
