"""How ``verify`` tells the layout of experts a checkpoint stores fused."""

from __future__ import annotations

import pytest

from msquant.verify.fused_experts import fused_layout


@pytest.mark.parametrize(
    ("gate_up", "down", "transposed"),
    [
        ((4, 32, 64), (4, 64, 16), False),  # transformers' layout
        ((4, 64, 32), (4, 16, 64), True),  # released layout
        ((4, 64, 64), (4, 64, 32), False),  # 2I == H: the down tensor decides
        ((4, 64, 64), (4, 32, 64), True),
        ((4, 64, 32), (4, 64, 16), None),  # neither
        ((4, 64), (4, 64, 16), None),
    ],
)
def test_fused_layout(
    gate_up: tuple[int, ...], down: tuple[int, ...], transposed: bool | None
) -> None:
    assert fused_layout(gate_up, down) is transposed
