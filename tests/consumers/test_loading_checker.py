"""The consumer suite's own checker of expert slots (``loading._fits_expert_slot``): a checker that
accepts a wrong shape would let every engine case pass on a broken export, so its rules are pinned
here, in the default suite (nothing is downloaded)."""

from __future__ import annotations

import pytest
from loading import _fits_expert_slot


@pytest.mark.parametrize(
    ("slot", "shapes", "fits"),
    [
        ((64, 32), [(64, 32)], True),  # one shard of the slot's shape
        ((64, 32), [(32, 32)], False),
        ((64, 32), [(32, 32), (32, 32)], True),  # gate and up stacked along the rows
        ((64, 16), [(64, 8), (64, 8)], True),  # ... or along the columns
        ((64, 32), [(64, 32), (64, 32)], False),  # gate and up each as large as w13
        ((64, 32), [(16, 32), (16, 32)], False),  # half of w13 in all
        ((64, 32), [(32, 32), (32, 16)], False),  # unequal shards
        ((2,), [(2,), (2,)], True),  # per-shard metadata (weight_shape) repeated
        ((), [(), ()], True),  # a scalar input scale per shard
        ((2,), [(1,), (1,)], True),
    ],
)
def test_expert_slot_rules(
    slot: tuple[int, ...], shapes: list[tuple[int, ...]], fits: bool
) -> None:
    assert _fits_expert_slot(slot, shapes) is fits
