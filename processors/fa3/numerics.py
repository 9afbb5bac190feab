"""FA3 numerics: msModelSlim's recall-window range and its per-head scales, as pure functions.

``fa3_quant``'s static (``per_head``) scheme observes, for every calibration forward, a tensor of
shape ``(batch, heads, seq, dim)`` at an attention point (MLA's absorbed ``q_nope``, its
normalised ``compressed_kv``) and keeps per head the narrowest window holding ``ratio`` of the
samples (the *recall window*); the running range is the elementwise min of the windows' left ends
and max of their right ends over the forwards. The scale is then msModelSlim's symmetric int8
one: ``max(-min(lo, 0), max(hi, 0)) / 127``, at least float32's eps, computed in the observed
tensor's dtype. The float8 (``fp8_e4m3``) scale is ``max(|lo|, |hi|)``, floored at ``1e-12``,
over e4m3's largest value 448 (``ir/api/impl/fp_quantization.py``); a value is then
``x / scale`` clamped to ``[-448, 448]`` and rounded to the nearest e4m3 value (torch's
``float8_e4m3fn`` cast: to nearest, ties to even). These functions reproduce msModelSlim 26.1.0's
results bit for bit (``msmodelslim/core/observer/recall_window.py``,
``ir/api/impl/int_quantization.py``; compared by ``tests/oracle/test_msmodelslim_fa3.py``).
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "INT8_MAX",
    "head_samples",
    "merge_range",
    "fp8_e4m3_fake_quant",
    "per_head_fp8_scale",
    "per_head_int8_scale",
    "per_token_fp8_fake_quant",
    "per_token_int8_fake_quant",
    "recall_window",
    "window_length",
]

INT8_MAX = 127
#: The largest finite float8 e4m3 (``float8_e4m3fn``) value: its clamp bound and scale divisor.
FP8_E4M3_MAX = 448.0
#: msModelSlim's floor of the float8 range's magnitude (before dividing by 448).
FP8_AMAX_FLOOR = 1e-12


def window_length(count: int, ratio: float) -> int:
    """How many of ``count`` sorted samples one window holds: ``int(ratio * count)``, computed in
    Python floats as msModelSlim does (``ratio`` 0.9999 drops one sample below 10 000)."""
    return int(ratio * count)


def head_samples(x: torch.Tensor) -> torch.Tensor:
    """The observed tensor ``(batch, heads, seq, dim)`` as one row per head.

    msModelSlim reads it as ``x.contiguous().view(heads, -1)``: row ``h`` is head ``h`` for a
    batch of one sample (msModelSlim calibrates one sample at a time), while for a batch of ``b``
    samples the rows cut the flat tensor into ``heads`` equal pieces, mixing samples and heads.
    msquant feeds FA3 one sample at a time (``batch_calibration`` off), so the two agree; with a
    larger batch this function still returns msModelSlim's rows, so the result stays its.
    """
    if x.dim() != 4:
        raise ValueError(f"expected a (batch, heads, seq, dim) tensor, got shape {tuple(x.shape)}")
    return x.contiguous().view(x.shape[1], -1)


def recall_window(samples: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``samples`` (``rows, n``), the ends of the narrowest window of
    ``int(ratio * n)`` consecutive sorted values; the first such window when several tie.

    msModelSlim compares the windows' widths as Python floats (each end read with ``.item()``,
    the width computed in double precision); the same widths are computed here in float64, and
    ``argmin`` returns the first minimum as its strict ``<`` scan does. The ends keep
    ``samples``' dtype.

    :raises ValueError: when a row holds no sample or the window would hold none.
    """
    rows, count = samples.shape
    size = window_length(count, ratio)
    if count == 0 or size < 1:
        raise ValueError(
            f"a recall window of ratio {ratio} over {count} sample(s) holds no sample "
            "(calibrate with more tokens)"
        )
    ordered = torch.sort(samples, dim=-1).values
    starts = ordered[:, : count - size + 1]
    ends = ordered[:, size - 1 :]
    widths = ends.to(torch.float64) - starts.to(torch.float64)
    best = torch.argmin(widths, dim=-1, keepdim=True)
    return starts.gather(-1, best).squeeze(-1), ends.gather(-1, best).squeeze(-1)


def merge_range(
    running: tuple[torch.Tensor, torch.Tensor] | None, low: torch.Tensor, high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running per-head range after one more observation (elementwise min / max)."""
    if running is None:
        return low.clone(), high.clone()
    return torch.minimum(running[0], low), torch.maximum(running[1], high)


def per_head_int8_scale(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """msModelSlim's symmetric int8 scale of a range, in the range's dtype:
    ``max(-min(low, 0), max(high, 0)) / 127``, floored at float32's eps."""
    low = torch.minimum(low, torch.zeros_like(low))
    high = torch.maximum(high, torch.zeros_like(high))
    eps = torch.tensor([torch.finfo(torch.float32).eps]).type_as(low)
    return torch.maximum(torch.maximum(-low, high) / float(INT8_MAX), eps)


def _row_ranges(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` as rows of its last dimension, with each row's minimum and maximum (``[rows, 1]``):
    what the per-token schemes scale by."""
    rows = x.reshape(-1, x.shape[-1])
    # amin and amax, not aminmax: over a dimension torch 2.13's CPU aminmax is ~25x slower
    return rows, torch.amin(rows, dim=1, keepdim=True), torch.amax(rows, dim=1, keepdim=True)


def per_token_int8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """The dynamic (``per_token``) scheme's effect on ``x``: each row of the last dimension
    quantized to int8 with its own symmetric scale, then dequantized (what the consumer's
    attention computes with; msquant exports no tensor for it)."""
    rows, low, high = _row_ranges(x)
    scale = per_head_int8_scale(low, high)
    codes = torch.clamp(torch.round(rows / scale), -INT8_MAX - 1, INT8_MAX)
    return (codes * scale).reshape(x.shape).to(x.dtype)


def per_head_fp8_scale(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """msModelSlim's symmetric float8 e4m3 scale of a range, in the range's dtype:
    ``max(|low|, |high|)`` floored at ``1e-12``, divided by 448."""
    magnitude = torch.maximum(low.abs(), high.abs()).clamp(min=FP8_AMAX_FLOOR)
    return magnitude / FP8_E4M3_MAX


def fp8_e4m3_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to float8 e4m3 with ``scale`` (broadcast) and dequantized, in ``x``'s dtype:
    ``x / scale`` clamped to ``[-448, 448]``, rounded to the nearest e4m3 value (ties to even),
    times ``scale``."""
    scaled = torch.clamp(x / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes = scaled.to(torch.float8_e4m3fn)
    return (codes.to(scale.dtype) * scale).to(x.dtype)


def per_token_fp8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """The dynamic (``per_token``) float8 scheme's effect on ``x``: each row of the last
    dimension quantized to e4m3 with its own scale, then dequantized (what the consumer's
    attention computes with; msquant exports no tensor for it)."""
    rows, low, high = _row_ranges(x)
    return fp8_e4m3_fake_quant(rows, per_head_fp8_scale(low, high)).reshape(x.shape)
