"""The GPTQ solve of one weight given its Hessian, with msModelSlim's numerics (pure function).

The algorithm is the IST-DASLab / msModelSlim one: dead columns (zero Hessian diagonal) get
``H[i, i] = 1`` and ``W[:, i] = 0``; ``damp = percdamp * mean(diag H)`` is added to the diagonal;
input columns are quantized left to right in lazy batches of ``block_size``; each column's rounding
error is spread over the not-yet-quantized columns through the upper Cholesky factor ``U`` of
``H^-1``. Grid: :mod:`msquant.quant.int_quant` (signed codes, ``w = (q - offset) * scale``).

How this implementation gets the same result faster (identical in exact arithmetic):

* One factorisation instead of three. With ``J`` the index reversal and ``L = cholesky(J H J)``,
  ``R = J L J`` is upper triangular with ``H = R R^T`` and ``R^-1 = U``. Rewritten with ``R``, the
  reference's updates become "Babai" updates: once column ``j`` is quantized, every later column
  ``k`` receives ``(w_j^orig - q_j) * R[j, k] / R[k, k]``. Neither ``H^-1`` nor a triangular
  inverse is ever formed.
* Those updates bring each column to the reference's value exactly when it is quantized, so codes,
  per-channel and static-group parameters and the loss are the reference's; the order in which the
  updates are applied is free, so they are blocked for speed (nested ranges of 512, 128 and 16
  columns, see :func:`_sweep`), on a transposed, contiguous copy of the weight. ``block_size``
  therefore only matters where the reference's result depends on it: dynamic group parameters.
* Intermediate (not yet quantized) columns differ from the reference's running state, which
  per-group parameters without static groups are computed from (at each lazy-batch start). That
  state is recovered exactly by one small triangular solve per group (:func:`_dynamic_group_params`).

Everything is solved in float32 (``solve_dtype=torch.float64`` is available for checks); bf16/fp16
weights are upcast first. Codes are taken from the loop; they equal ``quantize`` of the final
fake-quantized weight because that weight lies on the grid.

With ``mse`` options, every place that derives grid parameters from weights (per-channel, static
groups, dynamic groups) runs the MSE clipping search of :mod:`msquant.quant.mse_clip` on the same
values instead of taking plain min/max; without them (the default) nothing changes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from msquant.backends.base import Backend
from msquant.backends.cpu import CpuBackend
from msquant.backends.device import DeviceSpec
from msquant.errors import QuantizationError
from msquant.quant.gptq_options import GPTQOptions
from msquant.quant.int_quant import qrange
from msquant.quant.minmax import check_weight
from msquant.quant.mse_clip import MSEOptions, range_qparams
from msquant.quant.quantized_weight import QuantizedWeight

__all__ = ["GPTQResult", "gptq_quantize", "resolve_block_size"]

_SUB_BLOCK = 16  # columns whose mutual updates are applied one column at a time
_PANEL = 512  # minimum width of the panels whose trailing update is one large addmm_


@dataclass(frozen=True)
class GPTQResult:
    """What GPTQ produced for one layer.

    :param quantized: int8 codes plus float32 scale/offset (``w = (q - offset) * scale``).
    :param loss: ``sum_j ||w_j - q_j||^2 / U[j, j]^2 / 2`` over input columns ``j`` (the
        reference's ``Losses`` summed), in the units of ``H = (2 / n) X^T X``.
    :param damp: absolute damping finally added to the Hessian diagonal.
    :param percdamp: the same damping relative to ``mean(diag H)``.
    :param damp_retries: how many times damping was raised after a failed Cholesky.
    :param dead_columns: input columns whose Hessian diagonal was zero (quantized to exactly 0).
    :param nsamples: calibration tokens behind the Hessian (0 when unknown).
    :param seconds: wall time of the solve.
    :param dtype: dtype of the weight that was quantized (default of :meth:`dequantized`).
    :param block_size: effective lazy-batch width (after clipping to in_features).
    :param static_groups: whether group parameters were fixed from the original weight up front.
    :param g_idx: per-group: the group of each input column, always the trivial
        ``i // group_size``; None per-channel.
    :param perm: act-order processing order of the input columns; None without ``desc_act``.
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
    """The lazy-batch width actually used: ``block_size`` clipped to in_features.

    ``block_size`` need not divide in_features: the last block is then shorter, exactly as in
    msModelSlim and the reference algorithm (so msModelSlim configs with ``block_size: 128`` run on
    models whose widths are not multiples of 128, e.g. SmolLM2's 576).

    :raises QuantizationError: naming the layer when ``block_size`` is not a positive integer.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise QuantizationError(
            f"{name}: GPTQ block_size must be a positive integer, got {block_size!r} "
            f"(weight shape {weight_shape})"
        )
    return min(block_size, weight_shape[1])


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    options: GPTQOptions | None = None,
    *,
    name: str = "layer",
    backend: Backend | None = None,
    hessian_scale: float = 1.0,
    nsamples: int = 0,
    solve_dtype: torch.dtype = torch.float32,
    **fields: Any,
) -> GPTQResult:
    """Quantize one ``[out, in]`` weight by GPTQ given its Hessian (neither is modified).

    :param hessian: ``[in, in]`` Hessian, or a multiple of it with ``hessian_scale`` saying which
        (e.g. the raw ``X^T X`` with ``hessian_scale = 2 / n``, which spares a copy).
    :param options: the solve's options (:class:`GPTQOptions`: grid, groups, act-order, damping,
        MSE search). ``desc_act`` per-group forces static groups so that the group of column ``i``
        stays ``i // group_size``.
    :param fields: instead of ``options``, its fields as keywords (for Python callers and tests).
    :param backend: runs the Cholesky and triangular solves (``CpuBackend`` when None).
    :param solve_dtype: float32 (default) or float64 for the linear algebra and the sweep.
    :raises QuantizationError: bad weight/Hessian shapes or values, bad ``block_size``, or a
        Cholesky that still fails after ``max_damp_retries`` damping increases.
    """
    if options is None:
        options = GPTQOptions(**fields)
    elif fields:
        raise TypeError(f"gptq_quantize: pass options or its fields, not both ({sorted(fields)})")
    bits, symmetric, group_size = options.bits, options.symmetric, options.group_size
    mse, full_range, desc_act = options.mse, options.full_range, options.desc_act
    started = time.perf_counter()
    backend = backend if backend is not None else CpuBackend(DeviceSpec("cpu"))
    # 1. Checks: weight (2-D, floating, finite, group divisibility), Hessian shape, block size.
    check_weight(weight, name, group_size)
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    out_features, in_features = shape
    if tuple(hessian.shape) != (in_features, in_features):
        raise QuantizationError(
            f"{name}: GPTQ Hessian has shape {tuple(hessian.shape)} but the weight {shape} needs "
            f"({in_features}, {in_features}); the activations fed to add_batch belong to another layer"
        )
    block = resolve_block_size(options.block_size, shape, name)
    device = weight.device
    static = options.static

    # 2. Working copy of the weight, transposed: row i holds input column i.
    work = torch.empty((in_features, out_features), dtype=solve_dtype, device=device)
    work.copy_(weight.detach().t())
    # The diagonal is handled on the host in float64 (some accelerators lack float64).
    hdiag = hessian.diagonal().detach().to(device="cpu", dtype=torch.float64) * hessian_scale
    if not bool(torch.isfinite(hdiag).all()):
        raise QuantizationError(f"{name}: GPTQ Hessian {tuple(hessian.shape)} contains NaN/Inf")

    # 3. Per-channel parameters come from the original rows (before dead columns are zeroed).
    if group_size is None:
        scale, offset = range_qparams(work, bits, symmetric, mse, dim=0, full_range=full_range)
        scale_t, offset_t = scale.unsqueeze(0), offset.unsqueeze(0)

    # 4. Dead columns: W[:, i] = 0 here, H[i, i] = 1 when the factor is built.
    dead_host = hdiag == 0
    hdiag[dead_host] = 1.0
    dead = dead_host.to(device)
    work[dead] = 0

    # 5. Group parameters: static ones from the whole weight now, dynamic ones during the sweep.
    if group_size is not None:
        n_groups = in_features // group_size
        if static:
            grouped = work.reshape(n_groups, group_size, out_features)
            scale_t, offset_t = range_qparams(
                grouped, bits, symmetric, mse, dim=1, full_range=full_range
            )
        else:
            scale_t = torch.zeros((n_groups, out_features), dtype=torch.float32, device=device)
            offset_t = torch.zeros_like(scale_t)

    # 6. Act-order: process columns by descending (dead-fixed) Hessian diagonal.
    perm = None
    if desc_act:
        perm = torch.argsort(hdiag, descending=True, stable=True).to(device)
        work = work.index_select(0, perm)

    # 7. Factor H = R R^T (R upper, processing order), raising the damping until it succeeds.
    rfac, damp, used_percdamp, retries = _factor(
        hessian,
        hessian_scale,
        hdiag,
        dead,
        perm,
        percdamp=options.percdamp,
        increment=options.damp_auto_increment,
        max_retries=options.max_damp_retries,
        backend=backend,
        name=name,
        shape=shape,
        dtype=solve_dtype,
    )
    rdiag = rfac.diagonal().clone()
    rfac.div_(rdiag)  # unit diagonal: rfac[j, k] = R[j, k] / R[k, k]

    # 8. The sweep over input columns.
    group_of = None
    if group_size is not None:
        order = perm if perm is not None else torch.arange(in_features, device=device)
        group_of = order // group_size
    codes_t, loss = _sweep(
        work,
        rfac,
        rdiag.square() * hessian_scale,
        scale_t,
        offset_t,
        group_of,
        group_size=group_size,
        static=static,
        block=block,
        bits=bits,
        symmetric=symmetric,
        backend=backend,
        mse=mse,
        full_range=full_range,
    )

    # 9. Back to [out, in] in the original column order; assemble the result.
    if perm is not None:
        unpermuted = torch.empty_like(codes_t)
        unpermuted[perm] = codes_t
        codes_t = unpermuted
    quantized = QuantizedWeight(
        codes_t.t().contiguous(),
        scale_t.t().contiguous().float(),
        offset_t.t().contiguous().float(),
        bits,
        symmetric,
        group_size,
    )
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
        dead_columns=int(dead.sum()),
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
    """Upper ``R`` with ``R R^T = (H + damp I) / hessian_scale`` in processing order.

    ``R = J L J`` where ``L`` is the lower Cholesky factor of the index-reversed Hessian. Damping is
    raised by ``increment`` after each failed factorisation, at most ``max_retries`` times.

    :returns: ``(R, damp, percdamp_used, retries)`` with ``damp`` in units of ``H``.
    """
    device = dead.device
    size = hdiag.shape[0]
    mean_diag = float(hdiag.mean())
    reverse = torch.arange(size - 1, -1, -1, device=device) if perm is None else perm.flip(0)
    dead_reversed = dead[reverse]
    used, damp, last_error = percdamp, percdamp * mean_diag, ""
    for attempt in range(max_retries + 1):
        used = percdamp + attempt * increment
        damp = used * mean_diag
        # 1. Reversed (and act-order permuted) copy of the Hessian as given (a multiple of H: the
        #    solve is invariant to that factor, so the dead fix and damping are divided by it).
        source = hessian.to(device=device)
        if perm is None:
            flipped = source.flip(0, 1).to(dtype)
        else:
            flipped = source.index_select(0, reverse).index_select(1, reverse).to(dtype)
        diagonal = flipped.diagonal()
        diagonal.masked_fill_(dead_reversed, 1.0 / hessian_scale)
        diagonal.add_(damp / hessian_scale)
        # 2. Cholesky through the backend; a failure or a non-finite factor means "more damping"
        #    (a NaN anywhere reaches the later diagonal entries, so the diagonal is checked).
        try:
            lower = backend.cholesky(flipped)
        except torch.linalg.LinAlgError as exc:
            last_error = str(exc).splitlines()[0]
            continue
        del flipped
        lower_diag = lower.diagonal()
        if not bool((torch.isfinite(lower_diag) & (lower_diag > 0)).all()):
            last_error = "the Cholesky factor is not finite and positive"
            continue
        return lower.flip(0, 1), damp, used, attempt
    raise QuantizationError(
        f"{name}: GPTQ Cholesky of the {size}x{size} Hessian failed for weight {shape} even with "
        f"percdamp {used:g} (damp {damp:g}) after {max_retries} damping increase(s) of "
        f"{increment:g} ({last_error}); raise percdamp, damp_auto_increment or max_damp_retries, "
        f"or check the calibration data"
    )


def _sweep(
    work: torch.Tensor,
    rfac: torch.Tensor,
    rdiag2: torch.Tensor,
    scale_t: torch.Tensor,
    offset_t: torch.Tensor,
    group_of: torch.Tensor | None,
    group_size: int | None,
    static: bool,
    block: int,
    bits: int,
    symmetric: bool,
    backend: Backend,
    mse: MSEOptions | None = None,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``work`` (``[in, out]``, processing order; updated in place).

    Columns are processed through nested ranges of decreasing width: panels (>= 512 columns),
    the lazy batches of ``block`` columns when dynamic group parameters depend on them, then 512,
    128 and 16 columns. Once a range is done, its errors update the rest of the enclosing range in
    one ``addmm_``; inside a 16-column range each column first receives the updates of the earlier
    columns of that range (``addmv_``). The partition changes only the order of the updates.

    :returns: int8 codes ``[in, out]`` (processing order) and the loss (0-d tensor).
    """
    qmin, qmax = qrange(bits)
    in_features, out_features = work.shape
    dtype, device = work.dtype, work.device
    dynamic = group_size is not None and not static
    orig = work.clone()  # row j becomes the error d_j = w_j^orig - q_j once column j is rounded
    codes_t = torch.empty((in_features, out_features), dtype=torch.int8, device=device)
    leaf_codes = torch.empty((_SUB_BLOCK, out_features), dtype=dtype, device=device)
    tmp = torch.empty(out_features, dtype=dtype, device=device)
    loss = torch.zeros((), dtype=dtype, device=device)
    cur_rows, orig_rows, code_rows = work.unbind(0), orig.unbind(0), leaf_codes.unbind(0)
    scale_rows, offset_rows = scale_t.unbind(0), offset_t.unbind(0)
    groups = [0] * in_features if group_of is None else group_of.tolist()
    # Widths of the nested ranges; with dynamic groups a panel holds whole batches and groups.
    unit = math.lcm(block, group_size or 1) if dynamic else 1
    widths = [unit * max(1, -(-_PANEL // unit))]
    if dynamic:
        widths.append(block)
    widths += [w for w in (_PANEL, 128, _SUB_BLOCK) if w < min(widths)]
    group_level = 1 if dynamic else -1

    def quantize_leaf(first: int, last: int) -> None:
        """Round columns ``[first, last)`` (at most 16), each after its in-range updates."""
        nonlocal loss
        for j in range(first, last):
            w = cur_rows[j]
            # 1. Updates from the earlier columns of this range.
            if j > first:
                w.addmv_(orig[first:j].t(), rfac[first:j, j])
            # 2. Round to the grid: c = clamp(round(w / scale + offset)).
            scale, offset = scale_rows[groups[j]], offset_rows[groups[j]]
            c = torch.div(w, scale, out=code_rows[j - first])
            if not symmetric:
                c.add_(offset)
            c.round_().clamp_(qmin, qmax)
            # 3. The error that later columns compensate: d_j = w_j^orig - (c - offset) * scale.
            if symmetric:
                orig_rows[j].addcmul_(c, scale, value=-1.0)
            else:
                orig_rows[j].addcmul_(torch.sub(c, offset, out=tmp), scale, value=-1.0)
        # 4. Codes and loss of the range: sum_j ||w_j - q_j||^2 R[j, j]^2 / 2.
        codes = leaf_codes[: last - first]
        codes_t[first:last].copy_(codes)
        if group_of is None:
            scales, offsets = scale_t, offset_t
        else:
            scales, offsets = scale_t[group_of[first:last]], offset_t[group_of[first:last]]
        err = work[first:last] - (codes - offsets) * scales
        loss += (err.square().sum(1) * rdiag2[first:last]).sum() / 2

    def process(first: int, last: int, level: int) -> None:
        """Quantize ``[first, last)``, whose rows hold the updates of every earlier column."""
        if level == len(widths):
            quantize_leaf(first, last)
            return
        for start in range(first, last, widths[level]):
            end = min(start + widths[level], last)
            # 5. Dynamic groups: parameters of the groups starting in this lazy batch.
            if level == group_level:
                assert group_size is not None
                _dynamic_group_params(
                    work, orig, rfac, start, end, group_size, bits, symmetric, scale_t, offset_t,
                    backend, mse, full_range,
                )  # fmt: skip
            process(start, end, level + 1)  # noqa: F821 (the cell is cleared after the sweep)
            # 6. The errors of this range update the rest of the enclosing one.
            if end < last:
                work[end:last].addmm_(rfac[start:end, end:last].t(), orig[start:end])

    try:
        process(0, in_features, 0)
    finally:
        # ``process`` calls itself, so its closure cell refers back to it: a reference cycle
        # that would keep the working copies (``work``, ``orig``, ``rfac``) alive until the next
        # garbage collection. Clearing the cell breaks it; they are freed on return.
        del process
    return codes_t, loss


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
    mse: MSEOptions | None = None,
    full_range: bool = False,
) -> None:
    """Parameters of the groups starting in ``[start, end)``, from the reference's running weight.

    At a lazy-batch start, the reference's value of a later column ``c`` is
    ``w_c^orig + sum_{i in [start, c]} g_i (R22^-1)[i, c]`` with ``g_i = (ours_i - w_i^orig) R[i, i]``
    and ``R22`` the trailing block of ``R`` (ours hold only the ``i = c`` term). Restricted to a
    window ``[start, stop)`` the inverse is that of ``R``'s diagonal block, hence
    ``reference = orig + N^-T (work - orig)`` with ``N`` the unit-diagonal window of ``rfac``
    (its inverse is formed explicitly: a small solve, then one matmul instead of a wide solve).
    """
    first = -(-start // group_size) * group_size
    for group_start in range(first, end, group_size):
        stop = group_start + group_size
        if start == 0:
            running = work[group_start:stop]
        else:
            window = rfac[start:stop, start:stop]
            eye = torch.eye(stop - start, dtype=window.dtype, device=window.device)
            inverse = backend.solve_triangular(window, eye, upper=True)[:, group_start - start :]
            delta = work[start:stop] - orig[start:stop]
            running = torch.addmm(orig[group_start:stop], inverse.t(), delta)
        scale, offset = range_qparams(running, bits, symmetric, mse, dim=0, full_range=full_range)
        scale_t[group_start // group_size].copy_(scale)
        offset_t[group_start // group_size].copy_(offset)
