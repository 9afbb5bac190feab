"""Activation-aware clipping search: round-to-nearest parameters whose range is shrunk, per row
(or group), to minimise the layer's output error on calibration data (pure functions).

The idea is AWQ's clip search (Lin et al. 2024), computed exactly from the layer's Hessian
``H = X^T X`` instead of sampled inputs: a row's group ``g`` with rounding error ``d = w_q - w``
changes the layer's outputs over the calibration tokens by ``X_g d``, whose squared norm is
``d^T H_gg d`` with ``H_gg`` the diagonal block of ``H`` for the group's input columns. Every
candidate range ``[p min, p max]`` for ``p = 1, 1 - 1/grid, ..., 1 - maxshrink`` is tried and
the one with the smallest error kept (ties keep the wider range, so ``p = 1``, plain min/max,
wins unless another is strictly better). Unlike :mod:`msquant.quant.mse_clip`, which weighs
every weight alike, an input column the calibration data drives hard counts for more.

Per-channel (one group per row) the error is the exact output error of the row; per-group the
cross terms between groups are left out, as AWQ does. Computed in float32 (``dtype`` for checks).
"""

from __future__ import annotations

import torch

from msquant.errors import QuantizationError
from msquant.quant.int_quant import compute_qparams, qrange, quantize
from msquant.quant.minmax import check_weight
from msquant.quant.mse_clip import shrink_factors
from msquant.quant.quantized_weight import QuantizedWeight

__all__ = ["hessian_clip_qparams", "quantize_weight_hessian_clip"]


def _diagonal_blocks(hessian: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``[groups, width, width]``: the Hessian's blocks for each group of input columns."""
    groups = hessian.shape[0] // width
    blocks = hessian.to(dtype).reshape(groups, width, groups, width)
    return torch.stack([blocks[g, :, g, :] for g in range(groups)])


def hessian_clip_qparams(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None,
    grid: int = 20,
    maxshrink: float = 0.5,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and signed offset of every row (or group) of ``weight`` ``[out, in]``, their range
    shrunk to minimise ``d^T H_gg d`` (any positive multiple of ``X^T X`` gives the same choice).

    :returns: ``(scale, offset)``, float32, ``[out, in // group_size]`` (``[out, 1]`` per-channel).
    """
    qmin, qmax = qrange(bits)
    out_features, in_features = weight.shape
    width = in_features if group_size is None else group_size
    values = weight.detach().to(dtype).reshape(out_features, in_features // width, width)
    blocks = _diagonal_blocks(hessian.detach().to(weight.device), width, dtype)
    low, high = values.amin(dim=-1), values.amax(dim=-1)
    best_scale, best_offset = compute_qparams(low, high, bits, symmetric)
    best_error: torch.Tensor | None = None
    for p in shrink_factors(grid, maxshrink):
        scale, offset = compute_qparams(low * p, high * p, bits, symmetric)
        s, o = scale.to(dtype).unsqueeze(-1), offset.to(dtype).unsqueeze(-1)
        fake = (torch.clamp(torch.round(values / s + o), qmin, qmax) - o) * s
        diff = fake - values
        error = torch.einsum("ogi,gij,ogj->og", diff, blocks, diff)
        if best_error is None:
            best_error, best_scale, best_offset = error, scale, offset
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_offset = torch.where(better, offset, best_offset)
    return best_scale, best_offset


def quantize_weight_hessian_clip(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None = None,
    name: str = "weight",
    grid: int = 20,
    maxshrink: float = 0.5,
) -> QuantizedWeight:
    """Round-to-nearest of a 2-D weight with the activation-aware clipping search.

    :raises QuantizationError: a bad weight (see :func:`msquant.quant.minmax.check_weight`) or a
        Hessian that does not match its input width.
    """
    check_weight(weight, name, group_size)
    width = int(weight.shape[1])
    if tuple(hessian.shape) != (width, width):
        raise QuantizationError(
            f"{name}: Hessian {tuple(hessian.shape)} does not match the weight's input width "
            f"{width}; the calibration inputs belong to another layer"
        )
    scale, offset = hessian_clip_qparams(
        weight, hessian, bits, symmetric, group_size, grid, maxshrink
    )
    codes = quantize(weight, scale, offset, bits, group_size)
    return QuantizedWeight(codes, scale, offset, bits, symmetric, group_size)
