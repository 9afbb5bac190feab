"""An independent, deliberately plain float64 GPTQ oracle for the tests (not used by msquant).

Textbook route of the IST-DASLab reference / msModelSlim 26.1: Cholesky of the damped Hessian,
``cholesky_inverse``, upper Cholesky of ``H^-1``; explicit Python loops over lazy batches and
columns; the per-column error ``(w - q) / U[j, j]`` updates the rest of the batch, then the batch
errors update the later columns. Grid parameters follow msModelSlim's float32 formulas (its
parameters are float32), everything else in float64 (or float32, on request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReferenceResult:
    """Codes ``[out, in]`` (int64), scale/offset ``[out, groups]`` (float64), loss, dequantized Q.

    ``unrounded`` holds ``w / scale + offset`` of every column just before rounding, so that a test
    can tell a genuine rounding tie from a real disagreement.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    loss: float
    dequantized: torch.Tensor
    unrounded: torch.Tensor


def reference_qparams(
    low: torch.Tensor, high: torch.Tensor, bits: int, symmetric: bool, full_range: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """msModelSlim's grid parameters, evaluated in float32 and returned as float64.

    ``full_range``: symmetric magnitude over ``2^(b-1) - 0.5`` (GPTQModel / llm-compressor)."""
    smallest = -(2 ** (bits - 1))
    largest = 2 ** (bits - 1) - 1
    eps = torch.finfo(torch.float32).eps
    low32 = torch.minimum(low.to(torch.float32), torch.zeros_like(low, dtype=torch.float32))
    high32 = torch.maximum(high.to(torch.float32), torch.zeros_like(high, dtype=torch.float32))
    if symmetric:
        scale = torch.maximum(-low32, high32) / (largest + 0.5 if full_range else largest)
        scale = torch.where(scale < eps, torch.full_like(scale, eps), scale)
        offset = torch.zeros_like(scale)
    else:
        steps = float(2**bits - 1)
        scale = high32 / steps - low32 / steps
        scale = torch.where(scale < eps, torch.full_like(scale, eps), scale)
        offset = torch.round(-low32 / scale) + smallest
    return scale.double(), offset.double()  # exact: float32 values


def reference_gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None,
    percdamp: float = 0.01,
    block_size: int = 128,
    desc_act: bool = False,
    static_groups: bool = False,
    dtype: torch.dtype = torch.float64,
    full_range: bool = False,
) -> ReferenceResult:
    """GPTQ of ``weight`` ``[out, in]`` with Hessian ``[in, in]``, linear algebra in ``dtype``.

    ``dtype=torch.float32`` gives the reference at msModelSlim's own precision (to measure how far
    float32 rounding alone moves a result away from the float64 one).
    """
    rows, cols = weight.shape
    smallest, largest = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    W = weight.detach().to(dtype).clone()
    H = hessian.detach().to(dtype).clone()
    groups = 1 if group_size is None else cols // group_size
    scale = torch.zeros(rows, groups, dtype=dtype)
    offset = torch.zeros(rows, groups, dtype=dtype)
    static = group_size is not None and (static_groups or desc_act)

    if group_size is None:  # per-channel: from the untouched rows
        s, o = reference_qparams(
            W.min(dim=1).values, W.max(dim=1).values, bits, symmetric, full_range
        )
        scale[:, 0], offset[:, 0] = s.to(dtype), o.to(dtype)

    for i in range(cols):  # dead columns
        if H[i, i] == 0:
            H[i, i] = 1.0
            W[:, i] = 0.0

    if static:
        assert group_size is not None
        for g in range(groups):
            part = W[:, g * group_size : (g + 1) * group_size]
            s, o = reference_qparams(
                part.min(dim=1).values, part.max(dim=1).values, bits, symmetric, full_range
            )
            scale[:, g], offset[:, g] = s, o

    order = list(range(cols))
    if desc_act:
        order = torch.argsort(torch.diagonal(H), descending=True, stable=True).tolist()
        W = W[:, order]
        H = H[order][:, order]

    damp = percdamp * torch.mean(torch.diagonal(H))
    for i in range(cols):
        H[i, i] += damp
    lower = torch.linalg.cholesky(H)
    inverse = torch.cholesky_inverse(lower)
    U = torch.linalg.cholesky(inverse, upper=True)

    codes = torch.zeros(rows, cols, dtype=torch.int64)
    unrounded = torch.zeros(rows, cols, dtype=torch.float64)
    Q = torch.zeros(rows, cols, dtype=dtype)
    loss = 0.0
    for first in range(0, cols, block_size):
        last = min(first + block_size, cols)
        W1 = W[:, first:last].clone()
        errors = torch.zeros_like(W1)
        for i in range(last - first):
            col = first + i
            if group_size is None:
                g = 0
            elif static:
                g = order[col] // group_size
            else:
                g = col // group_size
                if col % group_size == 0:  # recompute from the full (lazily updated) matrix
                    part = W[:, col : col + group_size]
                    s, o = reference_qparams(
                        part.min(dim=1).values, part.max(dim=1).values, bits, symmetric, full_range
                    )
                    scale[:, g], offset[:, g] = s.to(dtype), o.to(dtype)
            w = W1[:, i]
            unrounded[:, col] = w / scale[:, g] + offset[:, g]
            code = torch.clamp(torch.round(unrounded[:, col]), smallest, largest)
            q = (code - offset[:, g]) * scale[:, g]
            d = U[col, col]
            codes[:, col] = code.long()
            Q[:, col] = q
            loss += float(((w - q) ** 2).sum() / d**2 / 2)
            err = (w - q) / d
            W1[:, i:] -= err[:, None] * U[col, first:last][None, i:]
            errors[:, i] = err
        W[:, last:] -= errors @ U[first:last, last:]

    if desc_act:
        inverse_order = [0] * cols
        for position, column in enumerate(order):
            inverse_order[column] = position
        codes = codes[:, inverse_order]
        unrounded = unrounded[:, inverse_order]
        Q = Q[:, inverse_order]
    return ReferenceResult(codes, scale.double(), offset.double(), loss, Q.double(), unrounded)
