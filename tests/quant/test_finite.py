"""The NaN/Inf checks of :mod:`msquant.quant.finite`: the one-pass ``aminmax`` test must agree
with the elementwise definition wherever the bad value sits (vector lanes and tails) and for
every floating dtype the checks see (float8 widened)."""

from __future__ import annotations

import pytest
import torch

from msquant.quant.finite import all_finite, non_finite_count

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 15, 16, 17, 67])
def test_one_bad_value_found_at_every_position(dtype: torch.dtype, size: int) -> None:
    base = torch.randn(size, generator=torch.Generator().manual_seed(size))
    assert all_finite(base.to(dtype))
    assert non_finite_count(base.to(dtype)) == 0
    for position in range(size):
        for bad in (float("nan"), float("inf"), float("-inf")):
            values = base.clone()
            values[position] = bad
            values = values.to(dtype)
            expected = int((~torch.isfinite(values.float())).sum())
            if expected == 0:  # float8 e4m3fn has no Inf: it saturates or becomes NaN
                continue
            assert not all_finite(values), (position, bad)
            assert non_finite_count(values) == expected


def test_counts_several_and_handles_empty_and_2d() -> None:
    values = torch.randn(8, 33, generator=torch.Generator().manual_seed(0))
    values[0, 0] = float("nan")
    values[7, 32] = float("inf")
    values[3, 5] = float("-inf")
    assert not all_finite(values)
    assert non_finite_count(values) == 3
    assert non_finite_count(values.t()) == 3  # non-contiguous
    assert all_finite(torch.empty(0, 4))
    assert non_finite_count(torch.empty(0, 4)) == 0
    assert non_finite_count(torch.tensor([1, 2])) == 0  # integers hold no NaN
