"""Smoothing numerics (SmoothQuant family): per-channel scales that move activation outliers into
the weights, folded so that the float model computes the same function (pure functions).

A linear layer ``y = x W^T`` equals ``y = (x / s) (W * s)^T`` for any positive per-input-channel
``s``. Dividing an activation channel by ``s`` is free when the producer of ``x`` is a norm (its
weight divided by ``s``) or a linear layer (its output rows divided by ``s``); multiplying ``W``'s
columns by ``s`` is folded into ``W``. With ``s = a^alpha / w^beta`` (``a`` the activation's
per-channel absolute maximum over the calibration tokens, ``w`` the weights' per-input-channel
absolute maximum), large activation channels shrink and the weights absorb them, which makes
per-token int8 activations far more accurate.

These are msModelSlim 26.1.0's definitions, learned from its documentation and its observable
results (``tests/oracle``), re-implemented here:

* ``iter_smooth`` / ``smooth_quant``: ``s = clamp(a^alpha / w^(1-alpha), min=scale_min)`` with
  ``w`` clamped at 1e-5. For a norm -> linears subgraph ``w`` is the absolute column maximum over
  all the linears; for a linear -> linear pair (``up-down``, ``ov``, ``linear-linear``) msModelSlim
  takes the column maximum of the second linear's *signed* weights (clamped at 1e-5), which
  :func:`iter_weight_stat` reproduces.
* ``flex_smooth_quant``: ``s = clamp(a^alpha / w^beta, min=1e-5)`` with ``w`` the absolute column
  maximum (clamped at 1e-5); ``alpha`` and ``beta``, when not given, are searched on a 0.05 grid
  (:func:`search_alpha_beta`).
* ``ov`` (v_proj -> o_proj) with grouped-query attention: one scale per channel of each key/value
  head, shared by the query heads that read it: the mean (``iter_smooth``) or the maximum
  (``flex_smooth_quant``) over those heads (:func:`ov_scales_mean`, :func:`ov_scales_max`).

Every function computes in the tensors' dtype and returns the same dtype (float32 in practice:
the statistics of float32 models); the folds change tensors in place, as msModelSlim multiplies by
reciprocals (``w * (1 / s)``), so the rounding matches its exports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "WEIGHT_STAT_MIN",
    "abs_column_max",
    "flex_scales",
    "fold_into_norm",
    "fold_into_linear_rows",
    "fold_into_linear_columns",
    "iter_scales",
    "iter_weight_stat",
    "ov_scales_max",
    "ov_scales_mean",
    "SCREEN_BLOCKS",
    "SCREEN_MARGIN",
    "SmoothingSearch",
    "quant_int8_sym_rows",
    "search_alpha_beta",
    "smoothing_error",
    "update_channel_max",
]

#: Floor of a weight statistic (msModelSlim's), so that a zero column gives a finite scale.
WEIGHT_STAT_MIN = 1e-5
#: The grid of the alpha / beta search: 0, 0.05, ..., 1 (msModelSlim's step).
SEARCH_STEP = 0.05


def update_channel_max(running: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """The per-channel (last dimension) maximum of ``|x|`` over all of its rows, combined with
    ``running`` (the maximum over the batches seen so far, None for the first)."""
    current = x.reshape(-1, x.shape[-1]).abs().amax(dim=0)
    return current if running is None else torch.maximum(running, current)


def _clamp(x: torch.Tensor, low: float, dtype: torch.dtype) -> torch.Tensor:
    return x.to(torch.float32).clamp(min=low).to(dtype)


def abs_column_max(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-input-channel absolute maximum over the columns of every weight (``[out, in]``,
    equal ``in``), floored at :data:`WEIGHT_STAT_MIN`."""
    stat = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    return _clamp(stat, WEIGHT_STAT_MIN, weights[0].dtype)


def iter_weight_stat(weights: Sequence[torch.Tensor], signed: bool) -> torch.Tensor:
    """``iter_smooth``'s weight statistic: the absolute column maximum over ``weights`` (a norm
    -> linears subgraph), or with ``signed`` the column maximum of the one weight's signed values
    (msModelSlim's linear -> linear pairs), floored at :data:`WEIGHT_STAT_MIN`."""
    if not signed:
        return abs_column_max(weights)
    (weight,) = weights
    return _clamp(weight.amax(dim=0), WEIGHT_STAT_MIN, weight.dtype)


def iter_scales(
    act_max: torch.Tensor, weight_stat: torch.Tensor, alpha: float, scale_min: float
) -> torch.Tensor:
    """``iter_smooth`` / ``smooth_quant`` scales: ``a^alpha / w^(1 - alpha)``, floored at
    ``scale_min``, in ``weight_stat``'s dtype."""
    dtype = weight_stat.dtype
    scales = act_max.pow(alpha).to(weight_stat.device) / weight_stat.pow(1 - alpha)
    return _clamp(scales, scale_min, dtype)


def flex_scales(
    act_max: torch.Tensor, weight_stat: torch.Tensor, alpha: float, beta: float
) -> torch.Tensor:
    """``flex_smooth_quant`` scales: ``a^alpha / w^beta`` floored at 1e-5, in ``act_max``'s dtype."""
    return _clamp(act_max.pow(alpha) / weight_stat.pow(beta), 1e-5, act_max.dtype)


def ov_scales_mean(
    scales: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel scales of o_proj's input (``heads * head_dim``) reduced to one per channel of
    each key/value head by the mean over the query heads sharing it (consecutive heads, as
    ``repeat_kv`` lays them out).

    :returns: ``(o_scales, v_scales)``: the reduced scales repeated for every query head
        (``heads * head_dim``, o_proj's columns) and the reduced ones (``kv_heads * head_dim``,
        v_proj's rows).
    """
    _check_heads(scales, heads, kv_heads)
    head_dim = scales.numel() // heads
    reduced = scales.reshape(kv_heads, heads // kv_heads, head_dim).mean(dim=1)
    repeated = reduced.repeat_interleave(heads // kv_heads, dim=0)
    return repeated.reshape(-1), reduced.reshape(-1)


def ov_scales_max(
    act_max: torch.Tensor,
    weight_stat: torch.Tensor,
    alpha: float,
    beta: float,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flex_smooth_quant``'s o/v scales: the activation and weight statistics of o_proj's input
    channels reduced by their maximum over the query heads sharing a key/value head, then
    ``a^alpha / w^beta`` floored at 1e-5. Returns ``(o_scales, v_scales)`` as
    :func:`ov_scales_mean`."""
    _check_heads(act_max, heads, kv_heads)
    ratio = heads // kv_heads
    head_dim = act_max.numel() // heads
    act = act_max.reshape(-1, ratio, head_dim).amax(dim=1)
    weight = weight_stat.reshape(-1, ratio, head_dim).amax(dim=1)
    grouped = _clamp(act.pow(alpha) / weight.pow(beta), 1e-5, weight_stat.dtype)
    return grouped.repeat_interleave(ratio, dim=0).reshape(-1), grouped.reshape(-1)


def _check_heads(scales: torch.Tensor, heads: int, kv_heads: int) -> None:
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads or scales.numel() % heads:
        raise ValueError(
            f"ov smoothing: {scales.numel()} channels cannot be split into {heads} attention "
            f"heads sharing {kv_heads} key/value heads"
        )


@torch.no_grad()
def fold_into_norm(
    weight: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor, offset: float = 0.0
) -> None:
    """Divide a norm's output channels by ``scales`` (its weight and bias, in place). A norm
    scaling by ``offset + weight`` (Qwen3-Next's ``1 + weight``) gets ``(offset + weight) / s -
    offset``."""
    inverse = 1.0 / scales
    if bias is not None:
        bias.mul_(inverse)
    if offset:
        weight.add_(offset).mul_(inverse.reshape(weight.shape)).sub_(offset)
    else:
        weight.mul_(inverse.reshape(weight.shape))


@torch.no_grad()
def fold_into_linear_rows(
    weight: torch.Tensor, bias: torch.Tensor | None, scales: torch.Tensor
) -> None:
    """Divide a linear layer's outputs by ``scales`` (its weight rows and bias, in place)."""
    inverse = 1.0 / scales
    if bias is not None:
        bias.mul_(inverse)
    weight.mul_(inverse.reshape(-1, 1))


@torch.no_grad()
def fold_into_linear_columns(weight: torch.Tensor, scales: torch.Tensor) -> None:
    """Multiply a linear layer's input channels by ``scales`` (its weight columns, in place)."""
    weight.mul_(scales.reshape(1, -1))


def quant_int8_sym_rows(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 fake quantization of each row (last dimension) of ``x`` (codes in
    [-127, 127], scale ``max|row| / 127``): per-token activations, per-output-channel weights."""
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.div(x, step).round_().clamp_(-127, 127).mul_(step)


def smoothing_error(
    act: torch.Tensor,
    weight: torch.Tensor,
    alpha: float,
    beta: float,
    reference: torch.Tensor | None = None,
) -> float:
    """The search objective of ``flex_smooth_quant``: the root-mean-square error of the int8
    product (per-token activations, per-channel weights) after smoothing with
    ``|act|_max^alpha * |weight|_max^-beta``, relative to the root mean square of the float
    product ``act @ weight^T`` (``reference``, computed when not given).

    :param act: calibration inputs ``[tokens, in]``; ``weight``: ``[out, in]``.
    """
    golden = act @ weight.T if reference is None else reference
    normal = golden.pow(2).mean().sqrt()
    scale = act.abs().amax(dim=0, keepdim=True).pow(alpha) * weight.abs().amax(
        dim=0, keepdim=True
    ).pow(-beta)
    product = quant_int8_sym_rows(act / scale) @ quant_int8_sym_rows(weight * scale).T
    return float((product.sub_(golden).square_().mean().sqrt() / normal).item())


def _grid() -> list[float]:
    steps = round(1 / SEARCH_STEP)
    return [round(i * SEARCH_STEP, 2) for i in range(steps + 1)]


#: Relative margin of the screen (:meth:`SmoothingSearch.estimate`): a candidate whose exact
#: estimate exceeds the best one (or the error to beat) by more than this fraction is not computed
#: in the search's dtype. The estimate differs from the float32 objective only by the float32
#: rounding of the operands and of the product, measured at most 9e-7 relative on SmolLM2's rows
#: (84 pairs on each of 12 subgraphs), so 1e-3 leaves three orders of magnitude of room; every
#: candidate within it is computed exactly, so ties resolve as in the plain sweep.
SCREEN_MARGIN = 1e-3
#: Dtypes the screen runs in: the objective computed in them is within float32 rounding of the
#: exact one. bfloat16 / float16 products round to 8 / 11 significant bits, which moves the
#: objective by far more than the margin, so their searches compute every candidate.
_SCREEN_DTYPES = (torch.float32, torch.float64)
#: The screen sums its squared errors over this many blocks of the larger operand's rows (tokens,
#: or the weight's output rows where there are more of them), stopping once past the limit.
SCREEN_BLOCKS = 16


class _Progress:
    """How far :meth:`SmoothingSearch.estimate` got with one candidate: its scale, the int8 codes
    (transposed, ``[in, n]``) and steps (``[1, n]``) of the operand quantized whole (dropped once
    the estimate is complete), the squared errors summed over the first ``blocks`` blocks, and
    the estimate or lower bound they give."""

    __slots__ = ("scale", "codes", "steps", "squares", "blocks", "value")

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale
        self.codes: torch.Tensor | None = None
        self.steps: torch.Tensor | None = None
        self.squares = 0.0
        self.blocks = 0
        self.value = 0.0


class SmoothingSearch:
    """:func:`smoothing_error` for many ``(alpha, beta)`` candidates of one subgraph, with what
    the candidates share computed once: the column maxima of ``|act|`` and ``|weight|``, the float
    product and its root mean square; the scaled and quantized operands and the int8 product are
    written into buffers allocated once.

    Every candidate's :meth:`error` is bit-identical to :func:`smoothing_error`'s: the same float32
    operations on the same values, in the same order (element-wise operations round each element
    on its own; the product and the mean reduce tensors of the same shapes as there).
    :meth:`estimate` is the same objective from the exact int8 product of the same codes, block
    by block of rows, at a fraction of the cost on CPU (an int8 x int8 -> int32 product).

    :param act: calibration inputs ``[tokens, in]``; ``weight``: ``[out, in]``, same dtype.
    """

    def __init__(self, act: torch.Tensor, weight: torch.Tensor) -> None:
        self.act = act
        self.weight = weight
        self.act_max = act.abs().amax(dim=0, keepdim=True)
        self.weight_max = weight.abs().amax(dim=0, keepdim=True)
        self.reference = act @ weight.T
        self.normal = self.reference.pow(2).mean().sqrt()
        self._act = torch.empty_like(act)
        self._weight = torch.empty_like(weight)
        self._product = torch.empty_like(self.reference)
        self._errors: dict[tuple[float, float], float] = {}
        self._progress: dict[tuple[float, float], _Progress] = {}
        self._blocked: list[torch.Tensor] = []
        self._references: list[torch.Tensor] = []
        self._scaled: list[torch.Tensor] = []
        self._diffs: list[torch.Tensor] = []
        self._normal = math.nan

    @property
    def screens(self) -> bool:
        """Whether the sweeps screen by :meth:`estimate`: on CPU (an int8 product there is
        several times cheaper than the float one) in a dtype whose :meth:`error` is within
        float32 rounding of the exact objective."""
        return self.act.device.type == "cpu" and self.act.dtype in _SCREEN_DTYPES

    def error(self, alpha: float, beta: float) -> float:
        """:func:`smoothing_error` of ``(alpha, beta)`` (each pair computed once)."""
        key = (alpha, beta)
        if key not in self._errors:
            self._errors[key] = self._compute(alpha, beta)
        return self._errors[key]

    def _scale(self, alpha: float, beta: float) -> torch.Tensor:
        return self.act_max.pow(alpha) * self.weight_max.pow(-beta)

    def _compute(self, alpha: float, beta: float) -> float:
        scale = self._scale(alpha, beta)
        act = _quant_int8_sym_rows_(torch.div(self.act, scale, out=self._act))
        weight = _quant_int8_sym_rows_(torch.mul(self.weight, scale, out=self._weight))
        product = torch.mm(act, weight.T, out=self._product)
        return float((product.sub_(self.reference).square_().mean().sqrt() / self.normal).item())

    @property
    def _blocks_by_tokens(self) -> bool:
        """The blocks split the tokens (act's rows), or, where the weight has more output rows
        than there are tokens, the weight's rows (then act is quantized whole per candidate)."""
        return self.act.shape[0] >= self.weight.shape[0]

    def _layout(self) -> None:
        """The blocks, made on the first estimate: the larger operand's rows dealt out in turn
        (row ``i`` to block ``i % SCREEN_BLOCKS``, so each block samples every part of the
        calibration set), each block with its rows of the float product (``[rows, n]``)."""
        if self._blocked:
            return
        by_tokens = self._blocks_by_tokens
        rows = self.act if by_tokens else self.weight
        reference = self.reference if by_tokens else self.reference.T
        count = min(SCREEN_BLOCKS, rows.shape[0])
        self._blocked = [rows[i::count].contiguous() for i in range(count)]
        self._references = [reference[i::count].contiguous() for i in range(count)]
        scaled = (self._act if by_tokens else self._weight).view(-1)
        product = self._product.view(-1)
        self._scaled = [scaled[: b.numel()].view(b.shape) for b in self._blocked]
        self._diffs = [product[: r.numel()].view(r.shape) for r in self._references]
        self._normal = float(self.normal.item())

    def estimate(
        self, alpha: float, beta: float, limit: float = math.inf, blocks: int | None = None
    ) -> float:
        """:meth:`error` of ``(alpha, beta)`` from the exact product of the same int8 codes
        (``codes_a @ codes_w^T`` in int32, scaled by the two steps once per element), without the
        float32 rounding of the dequantized operands and of their product: the same codes and
        steps as :meth:`error`, so the two differ by float32 rounding only
        (:data:`SCREEN_MARGIN`). NaN where a step is 0 (an all-zero row, whose codes are 0/0 in
        :meth:`error` too).

        The squared errors are summed block by block (:data:`SCREEN_BLOCKS` blocks of rows,
        always in the same order, so the whole estimate does not depend on where it paused);
        once the sum so far exceeds ``limit`` (every term is a square, so the whole sum only
        grows), or after ``blocks`` blocks, the rest is left for a later call and that partial
        value, a lower bound of the whole, is returned instead.
        """
        self._layout()
        key = (alpha, beta)
        progress = self._progress.get(key)
        if progress is None:
            progress = self._progress[key] = _Progress(self._scale(alpha, beta))
        stop = len(self._blocked) if blocks is None else min(blocks, len(self._blocked))
        while progress.blocks < stop and not progress.value > limit:
            self._next_block(progress)
        if progress.blocks == len(self._blocked):
            progress.codes = progress.steps = None
        return progress.value

    def complete(self, alpha: float, beta: float) -> bool:
        """Whether :meth:`estimate` of ``(alpha, beta)`` has summed every block (its value is the
        whole estimate, not a lower bound)."""
        progress = self._progress.get((alpha, beta))
        return progress is not None and progress.blocks == len(self._blocked) > 0

    def forget_codes(self) -> None:
        """Drop the whole-operand codes kept for estimates left unfinished (recomputed if one is
        asked for again)."""
        for progress in self._progress.values():
            progress.codes = progress.steps = None

    def _next_block(self, progress: _Progress) -> None:
        by_tokens = self._blocks_by_tokens
        if progress.codes is None:
            whole = (
                torch.mul(self.weight, progress.scale, out=self._weight)
                if by_tokens
                else torch.div(self.act, progress.scale, out=self._act)
            )
            codes, steps = _int8_codes_(whole)
            progress.codes, progress.steps = codes.to(torch.int8).T, steps.T
            if not bool(steps.all()):
                progress.value, progress.blocks = math.nan, len(self._blocked)
                return
        assert progress.steps is not None
        index = progress.blocks
        rows, scaled, diff = self._blocked[index], self._scaled[index], self._diffs[index]
        if by_tokens:
            torch.div(rows, progress.scale, out=scaled)
        else:
            torch.mul(rows, progress.scale, out=scaled)
        codes, steps = _int8_codes_(scaled)
        progress.blocks += 1
        if not bool(steps.all()):
            progress.value, progress.blocks = math.nan, len(self._blocked)
            return
        product = torch._int_mm(codes.to(torch.int8), progress.codes)
        diff.copy_(product).mul_(steps).mul_(progress.steps).sub_(self._references[index])
        flat = diff.view(-1)
        progress.squares += float(torch.dot(flat, flat).item())
        progress.value = math.sqrt(progress.squares / self.reference.numel()) / self._normal


def _row_abs_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's ``max |x|`` (last dimension, kept), from a maximum and a minimum reduction: the
    same values as ``x.abs().amax(-1)`` (maxima are exact) without an ``|x|`` copy. Not
    ``torch.aminmax(x, dim=-1)``, which computes the same pair but is 20-70x slower on CPU
    (torch 2.13, float32 ``[1024, 576]`` to ``[3072, 576]``: 1.3-13.7 ms against 0.07-0.2 ms)."""
    return torch.maximum(x.amin(dim=-1, keepdim=True).neg_(), x.amax(dim=-1, keepdim=True))


def _int8_codes_(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (in place, ``x``'s dtype) and per-row steps of :func:`_quant_int8_sym_rows_`
    (a screened dtype: no clamp unless a step is 0, which the caller refuses)."""
    step = _row_abs_max(x).div_(127)
    return x.div_(step).round_(), step


#: Dtypes in which ``|x| / (max |x| / 127)`` rounds to at most 127 (a quotient off by a few units
#: in the last place stays below 127.5), so the clamp of :func:`quant_int8_sym_rows` cannot act
#: unless a step is 0. Not bfloat16: with 8 significant bits ``max / 127`` rounds low enough for
#: the quotient to round to 127.5 and then to 128 (on the bf16 tiny Qwen3, 1 row in 8 of some
#: candidates), which the clamp brings back to 127.
_NO_CLAMP_DTYPES = (torch.float32, torch.float64)


def _quant_int8_sym_rows_(x: torch.Tensor) -> torch.Tensor:
    """:func:`quant_int8_sym_rows` in place, with the same values in fewer passes over ``x``:
    each row's ``max |x|`` from its maximum and minimum (:func:`_row_abs_max`, no ``|x|`` copy),
    and in float32 / float64 no clamp where it cannot act (``|x| <= max``, so ``|x / step|``
    rounds to at most 127 unless a step is 0; :data:`_NO_CLAMP_DTYPES`)."""
    step = _row_abs_max(x).div_(127)
    x.div_(step).round_()
    if x.dtype not in _NO_CLAMP_DTYPES or bool((step == 0).any()):
        x.clamp_(-127, 127)
    return x.mul_(step)


def search_alpha_beta(act: torch.Tensor, weight: torch.Tensor) -> tuple[float, float, float]:
    """``flex_smooth_quant``'s search: the best ``alpha`` on the grid 0, 0.05, ..., 1 with
    ``beta = 1 - alpha``, then the best ``beta`` on the same grid with that ``alpha``, by
    :func:`smoothing_error` (ties go to the later grid point; the beta search keeps ``1 - alpha``
    unless a ``beta`` does at least as well).

    Both sweeps first screen every candidate by :meth:`SmoothingSearch.estimate` (exact int8
    products summed block by block, each candidate stopped once provably worse than the best so
    far; :func:`_screen`) and compute :func:`smoothing_error` only for the candidates within
    :data:`SCREEN_MARGIN` of the best estimate (or of the error to beat): the others are worse
    than one of those by more than rounding, so the argmin, its ties and the returned error are
    those of the plain sweep over every candidate. The alpha sweep's pick, when the screen
    leaves it alone, gets its error only if the beta sweep needs it (its estimate within the
    margin of the beta sweep's best, or no beta doing better): otherwise a beta candidate is
    provably better and the plain sweep's answer does not depend on that error. Where the screen
    does not apply (bfloat16, float16, not on CPU, an all-zero row) every candidate is computed.

    :returns: ``(alpha, beta, error)``.
    """
    search = SmoothingSearch(act, weight)
    grid = _grid()
    alphas = [(alpha, 1.0 - alpha) for alpha in grid]
    kept, _ = _screen(search, alphas, math.inf)
    if kept is not None and sum(kept) == 1:
        alpha_index: int | None = kept.index(True)
        best = None  # the error of alphas[alpha_index], computed below where needed
    else:
        alpha_index, best = _sweep(search, alphas, math.inf, kept)
    best_alpha = 0.0 if alpha_index is None else grid[alpha_index]
    betas = [(best_alpha, beta) for beta in grid]
    if best is None:
        assert alpha_index is not None
        known = search.estimate(*alphas[alpha_index])
        kept, limit = _screen(search, betas, known * (1 + SCREEN_MARGIN))
        if kept is None or known <= limit:
            best = search.error(*alphas[alpha_index])
    else:
        kept, _ = _screen(search, betas, best * (1 + SCREEN_MARGIN))
    beta_index, error = _sweep(search, betas, math.inf if best is None else best, kept)
    if beta_index is None and best is None:  # not reached: the screen kept a better beta
        assert alpha_index is not None
        error = search.error(*alphas[alpha_index])
    return best_alpha, 0.0 if beta_index is None else grid[beta_index], error


def _screen(
    search: SmoothingSearch, candidates: list[tuple[float, float]], limit: float
) -> tuple[list[bool] | None, float]:
    """Which candidates may be the pick of a sweep that must beat an error whose estimate,
    within :data:`SCREEN_MARGIN`, is ``limit`` (``inf``: none); None (every candidate) where the
    screen does not apply or an estimate is not finite. Also returns the final limit.

    Best first: every candidate's estimate over the first block of rows (a lower bound of its
    whole estimate, and a fair guess of its rank), then, from the lowest of those up, each
    candidate's blocks until its estimate is whole or its partial sum (a lower bound) exceeds the
    limit, lowered to ``(1 + SCREEN_MARGIN)`` times each whole estimate below it. The limit only
    falls, so a candidate stopped above it is above the final limit too; so is a whole estimate
    above the final limit. Why such a candidate cannot be the pick: the final limit is ``(1 +
    SCREEN_MARGIN)`` times the estimate of the error to beat (which the candidate's error then
    exceeds) or times the whole estimate of a candidate ``d``; the estimates are within float32
    rounding ``r`` of the errors (partial sums of squares are at most the whole), so the stopped
    candidate's error exceeds that one by the factor ``(1 + SCREEN_MARGIN) / (1 + r)^2 > 1``: it
    is not a minimum, and a candidate that is not the minimum neither is the last minimum nor
    changes which one is. ``d`` is kept. The order of the screen changes how much it computes,
    never the answer.
    """
    if not search.screens:
        return None, limit
    firsts = [search.estimate(*candidate, limit, blocks=1) for candidate in candidates]
    finite = all(math.isfinite(first) for first in firsts)
    for index in sorted(range(len(candidates)), key=firsts.__getitem__) if finite else ():
        estimate = search.estimate(*candidates[index], limit)
        if not math.isfinite(estimate):
            finite = False
            break
        if search.complete(*candidates[index]):
            limit = min(limit, estimate * (1 + SCREEN_MARGIN))
    search.forget_codes()
    if not finite:
        return None, limit
    return [search.estimate(*candidate, limit) <= limit for candidate in candidates], limit


def _sweep(
    search: SmoothingSearch,
    candidates: list[tuple[float, float]],
    best: float,
    kept: list[bool] | None,
) -> tuple[int | None, float]:
    """msModelSlim's sweep over the ``kept`` candidates (None: all): the last candidate whose
    :func:`smoothing_error` is at most the best so far (starting from ``best``), and its error;
    ``None`` and ``best`` when none is."""
    pick = None
    for index, (alpha, beta) in enumerate(candidates):
        if kept is None or kept[index]:
            error = search.error(alpha, beta)
            if error <= best:
                pick, best = index, error
    return pick, best
