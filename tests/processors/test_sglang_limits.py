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
import msquant.plugin.planning


def _config(saver: str, group_size: int = 32, **entry: Any) -> dict[str, Any]:
    weight = {"scope": "per_group", "dtype": "int4", "symmetric": True, "method": "minmax"}
    weight["ext"] = {"group_size": group_size}
    process = [{"type": "linear_quant", "qconfig": {"weight": weight}, **entry}]
    return {"apiversion": "modelslim_v1", "spec": {"process": process, "save": [{"type": saver}]}}


def _sglang_warnings(model: Path, saver: str, group_size: int = 32, **entry: Any) -> list[str]:
    result = msquant.plugin.planning.build_plan(model, _config(saver, group_size, **entry))
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


def _act_config(scope: str, **entry: Any) -> dict[str, Any]:
    """int8 W8A8: per-channel int8 weights, int8 activations per tensor (static) or per token."""
    config = _config("compressed_tensors", **entry)
    qconfig = config["spec"]["process"][0]["qconfig"]
    qconfig["weight"] = {"scope": "per_channel", "dtype": "int8", "symmetric": True}
    qconfig["weight"]["method"] = "minmax"
    qconfig["act"] = {"scope": scope, "dtype": "int8", "symmetric": True, "method": "minmax"}
    return config


def _act_warnings(model: Path, scope: str, **entry: Any) -> list[str]:
    result = msquant.plugin.planning.build_plan(model, _act_config(scope, **entry))
    assert result.ok, result.errors
    return [w for w in result.warnings if "SGLang 0.5.23" in w]


def test_static_w8a8_loads_in_sglang_without_its_activation_scales(tiny_llama: Path) -> None:
    (warning,) = _act_warnings(tiny_llama, "per_tensor")
    assert warning == (
        "compressed_tensors: SGLang 0.5.23 loads these static int8 W8A8 layers but does not use "
        "their activation scales: CompressedTensorsW8A8Int8.apply_weights quantizes each token's "
        "activations itself (per_token_quant_int8, symmetric) and never reads the stored "
        "input_scale / input_zero_point, so SGLang serves them as per-token W8A8, not the "
        "calibrated static scheme msquant evaluated (model.layers.0.self_attn.q_proj, "
        "model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj, "
        "model.layers.0.self_attn.o_proj and 10 more); vLLM uses the stored scales"
    )
    assert _act_warnings(tiny_llama, "per_token") == []


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_w8a8_moe_experts_are_refused_by_sglang_on_a_gpu(
    arch: str, tiny_model_factory: Callable[..., Path]
) -> None:
    model = tiny_model_factory(arch, num_layers=2)
    warnings = _act_warnings(model, "per_token")
    (warning,) = [w for w in warnings if "MoE experts" in w]
    experts = [
        f"model.layers.{n}.mlp.experts"
        for n in range(2)
        if arch != "deepseek_v3" or n >= 1  # DeepSeek's first layer is dense
    ]
    assert warning == (
        "compressed_tensors: SGLang 0.5.23 cannot load int8 W8A8 MoE experts on a GPU: its "
        "compressed-tensors MoE scheme for them is implemented only for NPU "
        "(CompressedTensorsConfig.get_moe_scheme raises NotImplementedError), so it cannot load "
        f"this checkpoint ({', '.join(experts)}; vLLM can); for SGLang on a GPU keep the experts "
        "float: exclude ['*mlp.experts.*']"
    )
    assert _act_warnings(model, "per_token", exclude=["*mlp.experts.*"]) == []


@NEEDS_MOE_TRANSFORMERS
def test_deepseek_a_projections_warning_follows_the_scheme(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """int8 W8A8 per-token a-projections load in SGLang (no warning); static ones, weight-only
    compressed-tensors and GPTQ do not, each for its own tensors."""
    model = tiny_model_factory("deepseek_v3", num_layers=2)
    float_experts = ["*mlp.experts.*"]  # static activations are refused on routed experts
    assert _act_warnings(model, "per_token", exclude=float_experts) == []
    static_warnings = _act_warnings(model, "per_tensor", exclude=float_experts)
    (static,) = [w for w in static_warnings if "concatenates" in w]
    assert any("does not use their activation scales" in w for w in static_warnings)
    expected = {
        "static": (static, "the two per-tensor input_scale tensors give [2] against the [1]"),
        "weight_only": (
            _sglang_warnings(model, "compressed_tensors", group_size=16)[0],
            "compressed-tensors' two weight_shape vectors give [4] against the [2]",
        ),
        "gptq": (
            _sglang_warnings(model, "gptq_saver", group_size=16)[0],
            "GPTQ's packed qweight / qzeros / scales / g_idx cannot be joined that way",
        ),
    }
    for kind, (warning, reason) in expected.items():
        assert f"whose weight loader needs the joined shapes to match: {reason}" in warning, kind
        assert "(model.layers.0.self_attn, model.layers.1.self_attn; vLLM can)" in warning
        per_token_advice = "or quantize them int8 W8A8 with per-token activations"
        assert warning.endswith(per_token_advice) == (kind != "gptq"), warning
