"""The checks' error measures against hand computations in float64."""

from __future__ import annotations

import math

import torch

from msquant.check.compare import function_tolerance, max_relative_error, update_error


def test_max_relative_error_is_the_largest_difference_over_the_largest_value() -> None:
    expected = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    got = torch.tensor([[1.0, -4.0], [2.2, 0.5]])
    assert math.isclose(max_relative_error(expected, got), 0.2 / 4.0, rel_tol=1e-6)
    assert max_relative_error(expected, expected.clone()) == 0.0
    assert max_relative_error(torch.zeros(2), torch.ones(2)) == math.inf
    assert max_relative_error(expected, got[:1]) == math.inf


def test_update_error_is_relative_to_what_the_layer_adds() -> None:
    """A residual stream of 100s with an update of units: a wrong update is a large error
    relative to the update, though a small one relative to the output."""
    inputs = torch.full((3, 4), 100.0, dtype=torch.float64)
    update = torch.tensor([[1.0, 0.0, -1.0, 2.0], [0.5, 0.5, 0.5, 0.5], [0.0, 3.0, 0.0, 0.0]])
    before = inputs + update
    after = inputs + 2 * update  # the branch doubled
    expected = float(torch.linalg.vector_norm(update) / torch.linalg.vector_norm(update))
    assert math.isclose(update_error(inputs, before, after), expected)
    assert max_relative_error(before, after) < 0.03  # what a relative-to-output check would see
    assert update_error(inputs, before, before.clone()) == 0.0
    # a layer adding nothing is measured against its output
    assert math.isclose(update_error(before, before, before * 1.01), 0.01, rel_tol=1e-9)


def test_function_tolerance_by_weight_dtype() -> None:
    assert function_tolerance(torch.float32) == function_tolerance(torch.float64) == 1e-3
    assert function_tolerance(torch.bfloat16) == function_tolerance(torch.float16) == 2e-2
