"""The plan-time warnings about what SGLang 0.5.23's model classes cannot load (established with
SGLang's own code in tests/consumers/test_sglang.py); here on the weightless plan, no download."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import NEEDS_MOE_TRANSFORMERS

import msquant
import msquant.plugin


def _config(saver: str, group_size: int = 32, **entry: Any) -> dict[str, Any]:
    weight = {"scope": "per_group", "dtype": "int4", "symmetric": True, "method": "minmax"}
    weight["ext"] = {"group_size": group_size}
    process = [{"type": "linear_quant", "qconfig": {"weight": weight}, **entry}]
    return {"apiversion": "modelslim_v1", "spec": {"process": process, "save": [{"type": saver}]}}


def _sglang_warnings(model: Path, saver: str, group_size: int = 32, **entry: Any) -> list[str]:
    result = msquant.plugin.build_plan(model, _config(saver, group_size, **entry))
    assert result.ok, result.errors
    return [w for w in result.warnings if "SGLang 0.5.23" in w]


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("saver", ["gptq_saver", "compressed_tensors"])
def test_quantized_mixtral_head(saver: str, tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("mixtral", num_layers=2, intermediate_size=32)
    (warning,) = _sglang_warnings(model, saver, lm_head=True)
    assert warning.startswith(f"{saver}: SGLang 0.5.23 builds Mixtral's lm_head without")
    assert _sglang_warnings(model, saver) == []


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("saver", ["gptq_saver", "compressed_tensors"])
def test_deepseek_a_projections(saver: str, tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("deepseek_v3", num_layers=2)
    (warning,) = _sglang_warnings(model, saver, group_size=16)  # kv_b_proj has 16 inputs
    assert "concatenates each layer's q_a_proj and kv_a_proj_with_mqa" in warning
    assert "model.layers.0.self_attn, model.layers.1.self_attn;" in warning
    kept_float = ["*q_a_proj", "*kv_a_proj_with_mqa"]
    assert _sglang_warnings(model, saver, group_size=16, exclude=kept_float) == []


@pytest.mark.parametrize(
    ("entry", "fused"),
    [
        (
            {"exclude": [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]},
            "0.self_attn.qkv_proj",
        ),
        ({"dynamic": {r"model\.layers\.1\.mlp\..*": {"bits": 8}}}, "1.mlp.gate_up_proj"),
    ],
    ids=["float_qkv", "other_group"],
)
def test_compressed_tensors_fused_layers_outside_the_linear_group(
    tiny_llama: Path, entry: dict[str, Any], fused: str
) -> None:
    (warning,) = _sglang_warnings(tiny_llama, "compressed_tensors", **entry)
    assert "llama class declares no packed_modules_mapping" in warning
    listed = warning.split("stored otherwise (another group or float): ")[1].split(";")[0]
    assert listed == f"model.layers.{fused}"
    # GPTQ rules are matched per fused name by SGLang (dynamic): no such limit
    assert _sglang_warnings(tiny_llama, "gptq_saver", **entry) == []


@NEEDS_MOE_TRANSFORMERS
def test_compressed_tensors_float_mixtral_experts(tiny_model_factory: Callable[..., Path]) -> None:
    model = tiny_model_factory("mixtral", num_layers=2, intermediate_size=32)
    (warning,) = _sglang_warnings(model, "compressed_tensors", exclude=["*layers.1.mlp.experts.*"])
    assert "experts.N.gate_proj, not by the checkpoint's experts.N.w1" in warning
    assert "model.layers.1.mlp.experts)" in warning
    assert _sglang_warnings(model, "gptq_saver", exclude=["*layers.1.mlp.experts.*"]) == []
