"""Round-to-nearest integer quantization kernels with msModelSlim's numerics (pure functions).

Signed codes in ``[-2^(b-1), 2^(b-1)-1]`` for both symmetric and asymmetric schemes:

* symmetric: ``scale = max(|min|, |max|) / (2^(b-1) - 1)``, ``offset = 0`` (with ``full_range``:
  ``/ (2^(b-1) - 0.5)``, GPTQModel's and llm-compressor's convention, which also uses the code
  ``-2^(b-1)``: a step 7 % finer at int4, 0.4 % at int8);
* asymmetric: ``scale = max / (2^b - 1) - min / (2^b - 1)``,
  ``offset = round(-min / scale) - 2^(b-1)`` (a signed, integral zero point);
* min and max are first widened to include 0, and ``scale`` is floored at float32 epsilon;
* ``q = clamp(round(w / scale + offset))``; ``w' = (q - offset) * scale``.

Everything is computed in float32 whatever the weight's dtype, so bf16/fp16 weights work.
"""

from __future__ import annotations

import torch

__all__ = ["qrange", "compute_qparams", "quantize", "dequantize", "minmax_qparams"]

EPS = torch.finfo(torch.float32).eps


def qrange(bits: int) -> tuple[int, int]:
    """Signed code range ``(qmin, qmax)`` for a bit width, e.g. ``(-128, 127)`` for 8 bits."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8, got {bits}")
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def compute_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    bits: int,
    symmetric: bool,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and signed offset from observed minima and maxima (any matching shapes).

    :param full_range: symmetric only: divide the magnitude by ``2^(b-1) - 0.5`` instead of
        msModelSlim's ``2^(b-1) - 1`` (ignored when asymmetric).

    :returns: ``(scale, offset)``, both float32 and shaped like the inputs.
    """
    qmin, qmax = qrange(bits)
    # 1. Widen the range so that 0 is exactly representable.
    min_val = torch.clamp(min_val.float(), max=0.0)
    max_val = torch.clamp(max_val.float(), min=0.0)
    if symmetric:
        # 2a. One scale covering the larger magnitude; the zero point is 0.
        scale = torch.maximum(-min_val, max_val) / (qmax + 0.5 if full_range else qmax)
        scale = torch.clamp(scale, min=EPS)
        offset = torch.zeros_like(scale)
    else:
        # 2b. The full [min, max] range spread over all 2^b codes, zero point shifted to signed.
        levels = float(2**bits - 1)
        scale = max_val / levels - min_val / levels
        scale = torch.clamp(scale, min=EPS)
        offset = torch.round(-min_val / scale) + qmin
    return scale, offset


def _grouped(tensor: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """View ``[out, in]`` as ``[out, groups, group_size]`` (one group per row when per-channel)."""
    out_features, in_features = tensor.shape
    width = in_features if group_size is None else group_size
    return tensor.reshape(out_features, in_features // width, width)


def minmax_qparams(
    weight: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel or per-group round-to-nearest parameters of a 2-D weight.

    :returns: ``(scale, offset)`` float32 tensors of shape ``[out, in // group_size]``
        (``[out, 1]`` when ``group_size`` is None).
    """
    grouped = _grouped(weight.float(), group_size)
    return compute_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), bits, symmetric, full_range)


def quantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int | None,
) -> torch.Tensor:
    """Signed integer codes (int8 storage) of a 2-D weight under the given parameters."""
    qmin, qmax = qrange(bits)
    grouped = _grouped(weight.float(), group_size)
    codes = torch.round(grouped / scale.unsqueeze(-1) + offset.unsqueeze(-1))
    return torch.clamp(codes, qmin, qmax).to(torch.int8).reshape(weight.shape)


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int | None
) -> torch.Tensor:
    """Float32 weight ``(codes - offset) * scale`` with per-channel or per-group broadcasting."""
    grouped = _grouped(codes.float(), group_size)
    weight = (grouped - offset.unsqueeze(-1)) * scale.unsqueeze(-1)
    return weight.reshape(codes.shape)
