"""The numerics of ``method: ssz``: msModelSlim's per-channel scale search (a pure function).

msModelSlim's SSZ starts from the symmetric min/max scale of each output channel and alternates
two steps, at most ``steps`` times: round the weights to codes under the current scales, then
give each channel the least-squares scale of those codes, ``s = <w, q> / <q, q>``. Each channel
keeps the scale with the smallest mean squared weight error seen so far (the search goes on from
the latest scales, not the kept ones), and the search stops early once no channel improves by
more than ``1e-10`` (relative, or absolute). The result is round-to-nearest under the kept
scales, so it never has a larger weight error per channel than min/max scaling.

Established from msModelSlim 26.1.0's documentation (``quantization_algorithms/ssz.md``: min/max
start, least-squares steps, greedy keep, relative and absolute convergence test), the facts of its
source (the constants, that only symmetric per-channel int8 / int4 is registered) and its
observable behaviour: its quantizer run on random, heavy-tailed and edge-case weights
(``tests/oracle/test_ssz_oracle.py``) gives the same codes and scales as this function, bit for
bit. The reductions run over the input dimension of the transposed weight in float32, as
msModelSlim's do, so that the float32 sums round alike.
"""

from __future__ import annotations

import torch

from msquant.plugin.numerics import qrange

__all__ = ["DEFAULT_STEPS", "MAX_STEPS", "ssz_scales", "ssz_codes"]

#: msModelSlim's default number of search steps (``ext.step`` unset or not a positive integer).
DEFAULT_STEPS = 50
#: The most search steps ``ext.step`` may ask for: each step rounds the whole weight again, and
#: the search stops once the error settles (usually within a few dozen steps).
MAX_STEPS = 1000
#: Stop once no channel's error changes by more than this (relative or absolute).
CONVERGED = 1e-10
#: The smallest ``<q, q>`` divided by (channels whose codes are all zero get a zero scale).
MIN_NORM = 1e-30
#: The floor of the min/max starting scale (float32 eps), as msModelSlim's and msquant's minmax.
EPS = torch.finfo(torch.float32).eps


def ssz_codes(weight_t: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of the transposed weight ``[in, out]`` under per-channel ``scale`` ``[out]``, as
    float32 values (round half to even, clamped to the signed range)."""
    qmin, qmax = qrange(bits)
    return torch.clamp(torch.round(weight_t / scale), qmin, qmax)


def _mse(weight_t: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each channel (column) of the transposed weight."""
    return torch.mean(torch.pow(torch.abs(weight_t - codes * scale), 2), dim=0)


def ssz_scales(weight: torch.Tensor, bits: int, steps: int = DEFAULT_STEPS) -> torch.Tensor:
    """Per-output-channel symmetric scales of a 2-D weight ``[out, in]`` found by SSZ's search.

    :param weight: the float weight (computed in float32).
    :param bits: code width (8 or 4 in msModelSlim).
    :param steps: at most this many search steps.
    :returns: float32 scales ``[out]``.
    """
    weight_t = weight.float().t()
    _, qmax = qrange(bits)
    peak = torch.maximum(-weight_t.amin(dim=0).clamp(max=0), weight_t.amax(dim=0).clamp(min=0))
    scale = torch.clamp(peak / qmax, min=EPS)
    best_scale = scale
    codes = ssz_codes(weight_t, scale, bits)
    best_mse = _mse(weight_t, codes, scale)
    for _ in range(steps):
        scale = torch.sum(weight_t * codes, dim=0) / torch.sum(codes * codes, dim=0).clamp(
            min=MIN_NORM
        )
        codes = ssz_codes(weight_t, scale, bits)
        mse = _mse(weight_t, codes, scale)
        relative = (best_mse - mse) / best_mse.clamp(min=1e-4) < CONVERGED
        absolute = torch.abs(best_mse - mse) < CONVERGED
        if not bool(torch.any(~relative & ~absolute)):
            break
        better = mse < best_mse
        best_mse = torch.where(better, mse, best_mse)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale
