"""The numerics of ``flex_awq_ssz``: an AWQ-style search of the smoothing strength, measured
under the entry's own quantization (pure functions).

``flex_awq_ssz`` smooths a subgraph as ``flex_smooth_quant`` does, with ``beta`` fixed at 0: the
scale of input channel ``j`` is ``s_j = max(mean_t |x_tj|^alpha, 1e-5)`` (the mean absolute
activation over the calibration tokens, not the maximum), divided out of the producer and
multiplied into the consumer's columns. ``alpha`` is given or searched on the grid 0, 0.05, ...,
1. Each candidate is scored, as msModelSlim 26.1.0 scores it, by the relative root-mean-square
error of the quantized product against the float one:

* the candidate's scale is ``m_j^alpha`` with ``m_j = max_t |x_tj|`` (the maximum here, unlike the
  folded scale), without a floor;
* the weight ``W * s`` (columns) is fake-quantized by the entry's weight method (``ssz``,
  ``minmax``: :data:`WeightFakeQuant`, supplied by the caller);
* the activations ``x / s`` are fake-quantized to symmetric int8 with one step per *input
  channel* over all the tokens, ``max(max_t |x_tj| / 127, eps)``: the entry says
  ``per_token``, and msModelSlim's W4A8 / W8A8 dynamic fake-quantized linear layers, which score
  the candidate, take that minimum and maximum over the token dimension (its dimension 0) of
  the ``[tokens, in]`` input, so each channel, not each token, gets a step;
* the quantized product carries the consumer's bias (its fake-quantized layer adds it), the float
  reference ``x @ W^T`` does not;
* the error is ``rms(quantized - reference) / rms(reference)``; the best candidate is the one
  with the smallest error, a tie going to the later grid point.

These facts were read from msModelSlim 26.1.0's processor and its fake-quantized layers and are
checked against its exports (``tests/oracle/test_msmodelslim_awq.py``); the operations below run
in the inputs' dtype in its order, so that on float32 models the chosen ``alpha`` and the folded
weights are bit-identical to its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "ALPHA_GRID",
    "WeightFakeQuant",
    "AwqSearch",
    "fake_quant_int8_columns",
    "mean_abs",
    "search_alpha",
]

#: The candidates of the search: 0, 0.05, ..., 1 (msModelSlim's grid, rounded to 2 decimals).
ALPHA_GRID: tuple[float, ...] = tuple(round(i * 0.05, 2) for i in range(21))
#: float32 eps: the floor of an activation step (msModelSlim's ``calculate_qparam``).
EPS = torch.finfo(torch.float32).eps
#: Fake-quantizes a weight ``[out, in]``: returns the dequantized weight (same shape).
WeightFakeQuant = Callable[[torch.Tensor], torch.Tensor]


def mean_abs(rows: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The per-channel mean of ``|x|`` over every row (``[in]``): the activation statistic of
    ``flex_awq_ssz``'s folded scales. ``rows`` are ``[tokens, in]`` batches, joined first (one
    reduction over all the rows, as msModelSlim computes it)."""
    act = rows if isinstance(rows, torch.Tensor) else torch.cat(list(rows), dim=0)
    return torch.mean(torch.abs(act.reshape(-1, act.shape[-1])), dim=0)


def fake_quant_int8_columns(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 fake quantization of ``x`` ``[tokens, in]`` with one step per column
    (input channel): ``max(max(-min(min_t x, 0), max(max_t x, 0)) / 127, eps)``, codes
    rounded half to even and clamped to [-128, 127]."""
    low = torch.clamp(torch.amin(x, dim=0), max=0)
    high = torch.clamp(torch.amax(x, dim=0), min=0)
    step = torch.clamp(torch.maximum(-low, high) / 127.0, min=EPS)
    return torch.clamp(torch.round(x / step), -128, 127) * step


class AwqSearch:
    """The search objective of one subgraph's consumer: what every candidate shares (the float
    product, its root mean square, the per-channel maxima of ``|act|``) is computed once.

    :param act: calibration inputs ``[tokens, in]`` of the consumer, in its weight's dtype.
    :param weight: the consumer's weight ``[out, in]`` (for a norm's several linears, their
        weights stacked on the output dimension).
    :param bias: the consumer's bias (``[out]``), or None.
    :param fake_quant: the entry's weight quantization (dequantized result).
    """

    def __init__(
        self,
        act: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fake_quant: WeightFakeQuant,
    ) -> None:
        self.act = act
        self.weight = weight
        self.bias = bias
        self.fake_quant = fake_quant
        self.reference = torch.matmul(act, weight.T)
        self.normal = torch.mean(self.reference**2) ** 0.5
        self.act_max = torch.amax(torch.abs(act), dim=0, keepdim=True)

    def error(self, alpha: float) -> float:
        """The relative RMS error of the product quantized after smoothing with ``alpha``."""
        scale = self.act_max**alpha
        weight = self.fake_quant(self.weight * scale).to(self.act.dtype)
        act = fake_quant_int8_columns(self.act / scale)
        product = F.linear(act, weight, self.bias)
        rms = torch.mean(torch.abs(product - self.reference) ** 2) ** 0.5
        return float((rms / self.normal).item())


def search_alpha(
    act: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fake_quant: WeightFakeQuant,
    grid: Sequence[float] = ALPHA_GRID,
) -> tuple[float, float]:
    """``flex_awq_ssz``'s search: the ``alpha`` of ``grid`` with the smallest
    :meth:`AwqSearch.error` (a later candidate wins a tie; a NaN error never wins).

    :returns: ``(alpha, error)``; ``(grid[0], inf)`` when every error is NaN.
    """
    search = AwqSearch(act, weight, bias, fake_quant)
    best_alpha, best = grid[0], float("inf")
    for alpha in grid:
        error = search.error(alpha)
        if error <= best:
            best_alpha, best = alpha, error
    return best_alpha, best
