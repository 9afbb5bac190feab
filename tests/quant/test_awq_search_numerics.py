"""``flex_awq_ssz``'s numerics (:mod:`msquant.processors.smoothing.awq_search`) against float64
references written here from the definitions: the per-input-channel int8 fake quantization of
the activations, the mean absolute activation, the relative error of a candidate, the search's
choice (ties to the later candidate, NaN never chosen), and the float32 results against
float64 ones."""

from __future__ import annotations

import math

import pytest
import torch

from msquant.processors.smoothing import awq_search
from msquant.processors.smoothing.awq_search import (
    ALPHA_GRID,
    AwqSearch,
    fake_quant_int8_columns,
    mean_abs,
    search_alpha,
)

EPS32 = 1.1920928955078125e-07  # float32 eps: the floor of an activation step


def _ref_act_quant(x: torch.Tensor) -> torch.Tensor:
    """float64: each column gets step max(|column|) / 127 (at least eps), codes round half to
    even in [-128, 127]."""
    out = torch.empty_like(x, dtype=torch.float64)
    for j in range(x.shape[1]):
        column = x[:, j].double()
        step = max(float(column.abs().max()) / 127.0, EPS32)
        out[:, j] = torch.round(column / step).clamp(-128, 127) * step
    return out


def _ref_weight_quant(w: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """float64 symmetric per-output-channel min/max fake quantization (the test's weight method)."""
    qmax = 2 ** (bits - 1) - 1
    w = w.double()
    step = (w.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=EPS32)
    return torch.round(w / step).clamp(-qmax - 1, qmax) * step


def _ref_error(
    act: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, alpha: float
) -> float:
    """float64: the relative RMS error of the product quantized after smoothing with
    ``max|act|^alpha`` (per input channel), against ``act @ weight^T`` without the bias."""
    act, weight = act.double(), weight.double()
    scale = act.abs().amax(dim=0) ** alpha
    quantized = _ref_act_quant(act / scale) @ _ref_weight_quant(weight * scale).T
    if bias is not None:
        quantized = quantized + bias.double()
    reference = act @ weight.T
    rms = math.sqrt(float(((quantized - reference) ** 2).mean()))
    return rms / math.sqrt(float((reference**2).mean()))


def _data(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    act = torch.randn(96, 32, generator=gen, dtype=torch.float64)
    act[:, [3, 17]] *= 25.0  # outlier channels: smoothing pays off
    weight = torch.randn(24, 32, generator=gen, dtype=torch.float64) * 0.05
    return act.to(dtype), weight.to(dtype)


def test_grid_is_msmodelslims() -> None:
    assert ALPHA_GRID == tuple(round(0.05 * i, 2) for i in range(21))
    assert ALPHA_GRID[0] == 0.0 and ALPHA_GRID[-1] == 1.0


def test_activation_quant_has_one_step_per_input_channel() -> None:
    act, _ = _data(0)
    act[:, 5] = 0.0  # an all-zero channel: step eps, values stay 0
    torch.testing.assert_close(fake_quant_int8_columns(act), _ref_act_quant(act), rtol=0, atol=0)
    # the step follows the column, not the token: one token scaled up coarsens every other
    # token's values (per-token steps would leave them as they were)
    scaled = act.clone()
    scaled[0] *= 1000.0
    assert not torch.equal(fake_quant_int8_columns(scaled)[1:], fake_quant_int8_columns(act)[1:])


def test_mean_abs_over_every_batch() -> None:
    act, _ = _data(1)
    batches = [act[:40], act[40:41], act[41:]]
    expected = act.abs().sum(dim=0) / act.shape[0]
    torch.testing.assert_close(mean_abs(batches), expected, rtol=1e-15, atol=0)
    torch.testing.assert_close(mean_abs(act.reshape(2, 48, 32)), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("alpha", [0.0, 0.35, 1.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_candidate_error_equals_the_float64_reference(alpha: float, with_bias: bool) -> None:
    act, weight = _data(2)
    bias = torch.linspace(-0.1, 0.1, 24, dtype=torch.float64) if with_bias else None
    search = AwqSearch(act, weight, bias, lambda w: _ref_weight_quant(w))
    assert search.error(alpha) == pytest.approx(_ref_error(act, weight, bias, alpha), rel=1e-12)


def test_search_picks_the_smallest_error_and_float32_agrees() -> None:
    act, weight = _data(3)
    errors = {alpha: _ref_error(act, weight, None, alpha) for alpha in ALPHA_GRID}
    best = min(errors, key=lambda a: (errors[a], -a))
    alpha, error = search_alpha(act, weight, None, _ref_weight_quant)
    assert (alpha, error) == (best, pytest.approx(errors[best], rel=1e-12))
    assert best > 0  # the outlier channels make smoothing worth it
    assert errors[best] < 0.8 * errors[0.0]
    # float32 (msModelSlim's dtype on float32 models): the same choice, errors within 1e-5
    act32, weight32 = act.float(), weight.float()
    alpha32, error32 = search_alpha(act32, weight32, None, lambda w: _ref_weight_quant(w).float())
    assert alpha32 == best
    assert error32 == pytest.approx(errors[best], rel=1e-5)


def test_ties_go_to_the_later_candidate_and_nan_never_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    act, weight = _data(4)
    errors = {0.0: 0.5, 0.05: 0.2, 0.1: 0.2, 0.15: float("nan"), 0.2: 0.3}
    grid = tuple(errors)

    class Fixed(AwqSearch):
        def error(self, alpha: float) -> float:
            return errors[alpha]

    monkeypatch.setattr(awq_search, "AwqSearch", Fixed)
    assert search_alpha(act, weight, None, _ref_weight_quant, grid) == (0.1, 0.2)
    errors.update(dict.fromkeys(grid, float("nan")))
    assert search_alpha(act, weight, None, _ref_weight_quant, grid) == (0.0, math.inf)
