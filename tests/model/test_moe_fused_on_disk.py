"""Qwen3-VL-MoE's fused experts split into per-expert Linears: the same function in float64,
each Linear exactly msModelSlim's slice of the checkpoint, whichever layout the checkpoint stores
(transformers 5's ``[E, 2I, H]`` or the released ``[E, H, 2I]``; the exports are checked in
``tests/run/test_vlm_moe.py``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import NEEDS_MOE_TRANSFORMERS
from tiny_models import (
    VL_MOE_EXPERTS,
    VL_MOE_EXPERTS_MODULES,
    VL_MOE_HIDDEN,
    build_tiny_vl_moe,
    vl_moe_expert_weights,
)
from transformers import AutoModelForImageTextToText

from msquant.model.checkpoint_names import checkpoint_names
from msquant.model.moe import UnfusedExperts, unfuse_experts

pytestmark = NEEDS_MOE_TRANSFORMERS


@pytest.fixture(scope="module", params=["saved", "released"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl_moe(
        tmp_path_factory.mktemp(f"qwen3_vl_moe_{request.param}"), request.param
    )


def test_split_experts_reproduce_the_fused_ones_in_float64(checkpoint: Path) -> None:
    """Qwen3-VL-MoE's own experts module against the per-expert Linears, float64, random
    routing with masked slots; each Linear holds exactly msModelSlim's slice of the disk
    tensors."""
    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    expected_weights = vl_moe_expert_weights(checkpoint)
    fused = copy.deepcopy(model.get_submodule(VL_MOE_EXPERTS_MODULES[1])).double()
    assert type(fused).__name__ == "Qwen3VLMoeTextExperts"
    fused.config._experts_implementation = "eager"  # transformers' loop, which runs in float64
    unfused = UnfusedExperts.from_fused(fused)
    gen = torch.Generator().manual_seed(3)
    hidden_states = torch.randn(40, VL_MOE_HIDDEN, generator=gen, dtype=torch.float64)
    top_k_index = torch.randint(0, VL_MOE_EXPERTS, (40, 2), generator=gen)
    top_k_index[::7, 1] = VL_MOE_EXPERTS  # a masked slot (expert parallelism)
    top_k_weights = torch.rand(40, 2, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        expected = fused(hidden_states, top_k_index, top_k_weights)
        actual = unfused(hidden_states, top_k_index, top_k_weights)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    assert expected.abs().min() > 0

    unfuse_experts(model)
    names = checkpoint_names(model)
    for name, weight in expected_weights.items():
        linear = model.get_submodule(name)
        assert torch.equal(linear.weight.data, weight), name
        assert names.module_name(name) == name  # per-expert names, as msModelSlim writes them
