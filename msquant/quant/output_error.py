"""Relative output error of a quantized linear layer on its calibration activations.

For a layer ``y = x W^T`` and calibration inputs ``X`` (rows = tokens), the error the quantized
weight ``W_hat`` makes on those inputs, relative to the float output, is::

    ||X W^T - X W_hat^T||_F / ||X W^T||_F = sqrt(tr(D S D^T) / tr(W S W^T)),  D = W - W_hat

with ``S = X^T X`` (any positive multiple of it gives the same ratio, so the GPTQ accumulator's raw
sum serves as is). The trace form needs only the ``[in, in]`` sum GPTQ already keeps, never the
activations themselves. ``tr(A S A^T)`` is computed as ``sum((A S) * A)``: one product per weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["relative_output_errors"]


def _quadratic_traces(
    weights: Sequence[torch.Tensor], hessian: torch.Tensor, dtype: torch.dtype
) -> list[float]:
    """``tr(A S A^T)`` of each ``A`` in ``weights`` (all ``[out, in]``), computed in ``dtype``."""
    sym = hessian.to(dtype)
    stacked = torch.cat([w.to(device=sym.device, dtype=dtype) for w in weights], dim=0)
    rows = (stacked @ sym).mul_(stacked).sum(dim=1)
    traces: list[float] = []
    start = 0
    for w in weights:
        end = start + w.shape[0]
        traces.append(float(rows[start:end].sum(dtype=torch.float64)))
        start = end
    return traces


def relative_output_errors(
    weight: torch.Tensor,
    quantized: Sequence[torch.Tensor],
    hessian: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """``sqrt(tr(D S D^T) / tr(W S W^T))`` for each ``W_hat`` of ``quantized`` (``D = W - W_hat``).

    :param weight: the float weight ``W``, ``[out, in]``.
    :param quantized: dequantized weights ``W_hat`` of the same shape (e.g. GPTQ's and the
        round-to-nearest one, compared on the same activations in one pass).
    :param hessian: ``[in, in]`` symmetric positive semi-definite ``S = X^T X`` (or a positive
        multiple of it); the computation runs on its device.
    :param dtype: arithmetic dtype (float32 by default: the ratio needs no more; float64 for
        references).
    :returns: one relative error per entry of ``quantized``; ``0.0`` for all when the float
        output itself is zero (no signal to be relative to) and the weights agree, ``inf`` when
        only the quantized output is non-zero.
    :raises ValueError: on mismatched shapes.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    in_features = weight.shape[1]
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(
            f"hessian has shape {tuple(hessian.shape)}, expected ({in_features}, {in_features})"
        )
    for w_hat in quantized:
        if w_hat.shape != weight.shape:
            raise ValueError(
                f"quantized weight has shape {tuple(w_hat.shape)}, expected {tuple(weight.shape)}"
            )
    reference = weight.to(device=hessian.device, dtype=dtype)
    deltas = [reference - w_hat.to(device=hessian.device, dtype=dtype) for w_hat in quantized]
    signal, *errors = _quadratic_traces([reference, *deltas], hessian, dtype)
    return [_ratio(error, signal) for error in errors]


def _ratio(error: float, signal: float) -> float:
    """``sqrt(error / signal)`` with rounding noise (tiny negative traces) clamped to zero."""
    error = max(error, 0.0)
    if signal <= 0.0:
        return 0.0 if error == 0.0 else float("inf")
    return (error / signal) ** 0.5
