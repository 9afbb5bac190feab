"""GPTQ weight quantization with msModelSlim's numerics (per-channel and per-group, signed codes).

The algorithm is the IST-DASLab / msModelSlim one: dead columns (zero Hessian diagonal) get
``H[i, i] = 1`` and ``W[:, i] = 0``; ``damp = percdamp * mean(diag H)`` is added to the diagonal;
input columns are quantized left to right in lazy batches of ``block_size``; each column's rounding
error is spread over the not-yet-quantized columns through the upper Cholesky factor of ``H^-1``.

How this implementation gets the same result faster (exact arithmetic identical to the reference):

* One factorisation instead of three. With ``J`` the index reversal and ``L = cholesky(J H J)``,
  ``R = J L J`` is upper triangular with ``H = R R^T`` and ``R^-1 = U`` (the reference's factor).
  The reference's updates, rewritten with ``R``, become "Babai" updates: after quantizing column
  ``j``, every later column ``k`` receives ``(w_j^orig - q_j) * R[j, k] / R[k, k]``. No inverse of
  ``H`` or of a triangular factor is ever formed.
* These updates reach each column's final value exactly when it is quantized (so codes, the
  per-channel result and the loss are the reference's), but intermediate columns differ from the
  reference's running state. Per-group parameters without static groups are computed (as in the
  reference) from that running state at the start of each block; it is recovered exactly from
  ours by one small triangular solve per group (see :func:`_dynamic_group_params`).
* The per-column loop runs on a transposed, contiguous copy ``[in, out]`` (rows = columns), with
  rank-1 updates limited to sub-blocks of 16 columns and in-place ``addmm_`` for the rest.

Everything is solved in float32 (``solve_dtype=torch.float64`` is available for checks); bf16/fp16
weights are upcast first. Codes come out of the loop directly; they equal ``quantize`` of the
final fake-quantized weight because that weight lies on the grid.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from msquant.backends.base import Backend
from msquant.backends.cpu import CpuBackend
from msquant.backends.device import DeviceSpec
from msquant.errors import QuantizationError
from msquant.quant.hessian import HessianAccumulator
from msquant.quant.int_quant import compute_qparams, qrange
from msquant.quant.minmax import check_weight, divisors
from msquant.quant.quantized_weight import QuantizedWeight

__all__ = [
    "GPTQResult",
    "WeightPerChannelGPTQ",
    "WeightPerGroupGPTQ",
    "gptq_quantize",
    "GPTQ_EXT_DEFAULTS",
]

#: ``ext`` keys understood by the GPTQ classes and their defaults (msModelSlim's first three).
GPTQ_EXT_DEFAULTS: Mapping[str, Any] = {
    "percdamp": 0.01,
    "block_size": 128,
    "group_size": 128,
    "desc_act": False,
    "static_groups": False,
    "damp_auto_increment": 0.01,
    "max_damp_retries": 10,
}

_SUB_BLOCK = 16  # columns per rank-1 sub-block inside a lazy batch (speed only, not semantics)


@dataclass(frozen=True)
class GPTQResult:
    """What GPTQ produced for one layer.

    :param quantized: int8 codes plus float32 scale/offset (``w = (q - offset) * scale``).
    :param loss: ``sum_j ||w_j - q_j||^2 / U[j, j]^2 / 2`` over columns (the reference's ``Losses``).
    :param damp: absolute damping finally added to the Hessian diagonal.
    :param percdamp: the same damping relative to ``mean(diag H)``.
    :param damp_retries: how many times damping was raised after a failed Cholesky.
    :param dead_columns: input columns whose Hessian diagonal was zero (quantized to exactly 0).
    :param nsamples: calibration tokens behind the Hessian (0 when unknown).
    :param seconds: wall time of the solve.
    :param dtype: dtype of the weight that was quantized (default of :meth:`dequantized`).
    :param block_size: effective lazy-batch width (after clipping to in_features).
    :param static_groups: whether group parameters were fixed from the original weight up front.
    :param g_idx: per-group: group of each input column, always trivial ``i // group_size``; None
        per-channel.
    :param perm: act-order processing order of the input columns, None without ``desc_act``.
    """

    quantized: QuantizedWeight
    loss: float
    damp: float
    percdamp: float
    damp_retries: int
    dead_columns: int
    nsamples: int
    seconds: float
    dtype: torch.dtype
    block_size: int
    static_groups: bool
    g_idx: torch.Tensor | None
    perm: torch.Tensor | None

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The fake-quantized weight ``(q - offset) * scale`` in ``dtype`` (default: the input's)."""
        return self.quantized.dequantize().to(self.dtype if dtype is None else dtype)


def resolve_block_size(block_size: int, weight_shape: tuple[int, int], name: str) -> int:
    """Clip ``block_size`` to in_features, or check that it divides in_features.

    :raises QuantizationError: naming the layer, its shape and the valid block sizes.
    """
    in_features = weight_shape[1]
    if block_size >= in_features:
        return in_features
    if in_features % block_size != 0:
        raise QuantizationError(
            f"{name}: GPTQ block_size {block_size} does not divide in_features {in_features} "
            f"(weight shape {weight_shape}); valid block sizes: {divisors(in_features)}, "
            f"or any value >= {in_features}"
        )
    return block_size


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    bits: int = 8,
    symmetric: bool = True,
    group_size: int | None = None,
    percdamp: float = 0.01,
    block_size: int = 128,
    desc_act: bool = False,
    static_groups: bool = False,
    damp_auto_increment: float = 0.01,
    max_damp_retries: int = 10,
    name: str = "layer",
    backend: Backend | None = None,
    hessian_scale: float = 1.0,
    nsamples: int = 0,
    solve_dtype: torch.dtype = torch.float32,
) -> GPTQResult:
    """Quantize one ``[out, in]`` weight by GPTQ given its Hessian (not modified).

    :param hessian: ``[in, in]`` Hessian, or a multiple of it with ``hessian_scale`` saying which
        (e.g. the raw ``X^T X`` with ``hessian_scale = 2 / n``, sparing a copy).
    :param group_size: input columns per group, ``None`` for per-channel parameters.
    :param desc_act: act-order: quantize columns by descending Hessian diagonal. Per-group, this
        forces static groups so the group index of every column stays ``i // group_size``.
    :param static_groups: per-group parameters from the (dead-column-zeroed) original weight.
    :param backend: runs the Cholesky and triangular solves (``CpuBackend`` when None).
    :raises QuantizationError: bad weight/Hessian shapes or values, bad ``block_size``, or a
        Cholesky that still fails after ``max_damp_retries`` damping increases.
    """
    started = time.perf_counter()
    backend = backend if backend is not None else CpuBackend(DeviceSpec("cpu"))
    # 1. Checks: weight (2-D, floating, finite, group divisibility), Hessian shape, block size.
    check_weight(weight, name, group_size)
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    out_features, in_features = shape
    if tuple(hessian.shape) != (in_features, in_features):
        raise QuantizationError(
            f"{name}: GPTQ Hessian has shape {tuple(hessian.shape)} but the weight {shape} needs "
            f"({in_features}, {in_features}); the activations fed to add_batch do not belong to this layer"
        )
    block = resolve_block_size(block_size, shape, name)
    qmin, qmax = qrange(bits)
    device = weight.device
    static = group_size is not None and (static_groups or desc_act)

    # 2. Working copy of the weight, transposed: row i = input column i (float, contiguous).
    work = torch.empty((in_features, out_features), dtype=solve_dtype, device=device)
    work.copy_(weight.detach().t())
    hdiag = hessian.diagonal().to(device=device, dtype=torch.float32) * hessian_scale
    if not bool(torch.isfinite(hdiag).all()):
        raise QuantizationError(f"{name}: GPTQ Hessian {tuple(hessian.shape)} contains NaN/Inf")

    # 3. Per-channel parameters come from the original rows (before dead columns are zeroed).
    if group_size is None:
        scale_t, offset_t = compute_qparams(work.amin(0), work.amax(0), bits, symmetric)
        scale_t, offset_t = scale_t.unsqueeze(0), offset_t.unsqueeze(0)

    # 4. Dead columns: H[i, i] = 1 (done when the factor is built) and W[:, i] = 0.
    dead = hdiag == 0
    dead_count = int(dead.sum())
    work[dead] = 0
    hdiag[dead] = 1.0

    # 5. Group parameters: static ones from the whole weight now, dynamic ones per block later.
    n_groups = 1 if group_size is None else in_features // group_size
    if group_size is not None:
        if static:
            grouped = work.reshape(n_groups, group_size, out_features)
            scale_t, offset_t = compute_qparams(grouped.amin(1), grouped.amax(1), bits, symmetric)
        else:
            scale_t = torch.zeros((n_groups, out_features), dtype=torch.float32, device=device)
            offset_t = torch.zeros_like(scale_t)

    # 6. Act-order: process columns by descending (dead-fixed) Hessian diagonal.
    perm = torch.argsort(hdiag, descending=True, stable=True) if desc_act else None
    if perm is not None:
        work = work.index_select(0, perm)
        order = perm.tolist()
    else:
        order = list(range(in_features))
    group_of = [0] * in_features if group_size is None else [c // group_size for c in order]

    # 7. Factor H = R R^T (R upper, processing order), raising the damping until it succeeds.
    rfac, damp, used_percdamp, retries = _factor(
        hessian, hessian_scale, hdiag, dead, perm, percdamp, damp_auto_increment,
        max_damp_retries, backend, name, shape, solve_dtype,
    )  # fmt: skip
    rdiag = rfac.diagonal().clone()
    rfac.div_(rdiag)  # unit diagonal: rfac[j, k] = R[j, k] / R[k, k]
    rdiag2 = rdiag.square()

    # 8. The lazy-batch sweep over input columns.
    orig = work.clone()  # row j turns into the error d_j = w_j^orig - q_j once column j is done
    codes_t = torch.empty((in_features, out_features), dtype=torch.int8, device=device)
    scale_rows, offset_rows = scale_t.unbind(0), offset_t.unbind(0)
    cur_rows, orig_rows, code_rows = work.unbind(0), orig.unbind(0), codes_t.unbind(0)
    r_rows = rfac.unbind(0)
    tmp = torch.empty(out_features, dtype=solve_dtype, device=device)
    err = torch.empty((block, out_features), dtype=solve_dtype, device=device)
    loss = torch.zeros((), dtype=solve_dtype, device=device)
    for start in range(0, in_features, block):
        end = start + block
        # 8a. Per-group (dynamic): parameters of the groups starting in this block.
        if group_size is not None and not static:
            _dynamic_group_params(
                work, orig, rfac, start, end, group_size, bits, symmetric, scale_t, offset_t, backend
            )
        for sub_start in range(start, end, _SUB_BLOCK):
            sub_end = min(sub_start + _SUB_BLOCK, end)
            for j in range(sub_start, sub_end):
                # 8b. Round-to-nearest of the column with its group's parameters.
                scale, offset = scale_rows[group_of[j]], offset_rows[group_of[j]]
                w = cur_rows[j]
                torch.div(w, scale, out=tmp)
                if not symmetric:
                    tmp.add_(offset)
                tmp.round_().clamp_(qmin, qmax)
                code_rows[j].copy_(tmp)
                if not symmetric:
                    tmp.sub_(offset)
                tmp.mul_(scale)
                # 8c. Loss term and the error that later columns compensate.
                torch.sub(w, tmp, out=err[j - start])
                d = orig_rows[j].sub_(tmp)
                # 8d. Rank-1 update of the rest of the sub-block.
                if j + 1 < sub_end:
                    work[j + 1 : sub_end].addr_(r_rows[j][j + 1 : sub_end], d)
            # 8e. Update the rest of the lazy batch from this sub-block's errors.
            if sub_end < end:
                work[sub_end:end].addmm_(rfac[sub_start:sub_end, sub_end:end].t(), orig[sub_start:sub_end])
        # 8f. Lazy update of every later column from this batch's errors, and the loss.
        if end < in_features:
            work[end:].addmm_(rfac[start:end, end:].t(), orig[start:end])
        loss += (err.square().sum(1) * rdiag2[start:end]).sum() / 2

    # 9. Back to [out, in] in the original column order; assemble the result.
    if perm is not None:
        unpermuted = torch.empty_like(codes_t)
        unpermuted[perm] = codes_t
        codes_t = unpermuted
    codes = codes_t.t().contiguous()
    scale_out = scale_t.t().contiguous().float()
    offset_out = offset_t.t().contiguous().float()
    quantized = QuantizedWeight(codes, scale_out, offset_out, bits, symmetric, group_size)
    g_idx = None
    if group_size is not None:
        g_idx = torch.arange(in_features, device=device) // group_size
    loss_value = float(loss)
    backend.synchronize()
    return GPTQResult(
        quantized=quantized,
        loss=loss_value,
        damp=damp,
        percdamp=used_percdamp,
        damp_retries=retries,
        dead_columns=dead_count,
        nsamples=nsamples,
        seconds=time.perf_counter() - started,
        dtype=weight.dtype,
        block_size=block,
        static_groups=static,
        g_idx=g_idx,
        perm=perm,
    )


def _factor(
    hessian: torch.Tensor,
    hessian_scale: float,
    hdiag: torch.Tensor,
    dead: torch.Tensor,
    perm: torch.Tensor | None,
    percdamp: float,
    increment: float,
    max_retries: int,
    backend: Backend,
    name: str,
    shape: tuple[int, int],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, float, float, int]:
    """Upper ``R`` with ``R R^T = H + damp I`` in processing order, retrying with more damping.

    ``R = J L J`` where ``L`` is the lower Cholesky factor of the index-reversed Hessian.

    :returns: ``(R, damp, percdamp_used, retries)``.
    """
    device = hdiag.device
    n = hdiag.shape[0]
    mean_diag = float(hdiag.mean())
    reverse = torch.arange(n - 1, -1, -1, device=device) if perm is None else perm.flip(0)
    dead_reversed = dead[reverse]
    last_error = ""
    for attempt in range(max_retries + 1):
        used = percdamp + attempt * increment
        damp = used * mean_diag
        # 1. Reversed (and act-order permuted) copy of the scaled Hessian, dead fix, damping.
        if perm is None:
            flipped = hessian.to(device=device).flip(0, 1).to(dtype)
        else:
            h = hessian.to(device=device)
            flipped = h.index_select(0, reverse).index_select(1, reverse).to(dtype)
        if hessian_scale != 1.0:
            flipped.mul_(hessian_scale)
        diagonal = flipped.diagonal()
        diagonal.masked_fill_(dead_reversed, 1.0)
        diagonal.add_(damp)
        # 2. Cholesky through the backend; a failure or a non-finite factor means "more damping".
        try:
            lower = backend.cholesky(flipped)
        except torch.linalg.LinAlgError as exc:
            last_error = str(exc).splitlines()[0]
            continue
        del flipped
        if not bool(torch.isfinite(lower).all()):
            last_error = "the Cholesky factor contains NaN/Inf"
            continue
        return lower.flip(0, 1), damp, used, attempt
    raise QuantizationError(
        f"{name}: GPTQ Cholesky of the {n}x{n} Hessian failed for weight {shape} even with "
        f"percdamp {used:g} (damp {damp:g}) after {max_retries} damping increase(s) of "
        f"{increment:g} ({last_error}); raise percdamp / damp_auto_increment / max_damp_retries, "
        f"or check the calibration data"
    )


def _dynamic_group_params(
    work: torch.Tensor,
    orig: torch.Tensor,
    rfac: torch.Tensor,
    start: int,
    end: int,
    group_size: int,
    bits: int,
    symmetric: bool,
    scale_t: torch.Tensor,
    offset_t: torch.Tensor,
    backend: Backend,
) -> None:
    """Parameters of the groups starting in ``[start, end)``, from the reference's running weight.

    At a batch start, the reference's value of a later column ``c`` is
    ``w_c^orig + sum_{i in [start, c]} g_i (R22^-1)[i, c]`` where ``g_i = (ours_i - w_i^orig) R[i, i]``
    and ``R22`` is the trailing block of ``R`` (ours receive only the diagonal term). Restricted to
    a window ``[start, stop)``, the inverse is that of ``R``'s diagonal block, so
    ``reference = orig + N^-T (work - orig)`` with ``N`` the unit-diagonal window of ``rfac``.
    """
    first = -(-start // group_size) * group_size
    for group_start in range(first, end, group_size):
        stop = group_start + group_size
        if start == 0:
            running = work[group_start:stop]
        else:
            delta = work[start:stop] - orig[start:stop]
            window = rfac[start:stop, start:stop]
            solved = backend.solve_triangular(window.t(), delta, upper=False)
            running = orig[group_start:stop] + solved[group_start - start :]
        scale, offset = compute_qparams(running.amin(0), running.amax(0), bits, symmetric)
        scale_t[group_start // group_size].copy_(scale)
        offset_t[group_start // group_size].copy_(offset)
