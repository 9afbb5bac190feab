"""``--quant_type`` (msModelSlim's values) and ``--tag`` on the command line: each implemented
value selects a practice shipped in ``msquant/data/practices``, the others are refused naming
the implemented ones, exit code 2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS

import msquant
from msquant.config.presets import (
    FAMILY_PRACTICES,
    MSMODELSLIM_QUANT_TYPES,
    PRESETS,
    preset_config,
)
from msquant.plugin import Processor, ProcessorConfig

HAS_ITER_SMOOTH = "iter_smooth" in msquant.plugin.default_registry()


def description(save: Path) -> dict[str, Any]:
    return json.loads((save / "quant_model_description.json").read_text(encoding="utf-8"))


def test_every_msmodelslim_value_is_implemented_or_refused_by_name() -> None:
    assert sorted(PRESETS) == ["w4a8", "w8a16", "w8a8"]
    assert set(PRESETS) <= set(MSMODELSLIM_QUANT_TYPES)
    for value in set(MSMODELSLIM_QUANT_TYPES) - set(PRESETS):
        with pytest.raises(KeyError) as info:
            preset_config(value)
        assert info.value.args[0] == (
            f"quant_type {value!r} is one of msModelSlim's but msquant does not implement it; "
            "implemented: w4a8, w8a16, w8a8; or pass --config_path YAML"
        )
    with pytest.raises(KeyError, match="unknown quant_type 'w3a5'; available: w4a8, w8a16, w8a8"):
        preset_config("w3a5")


def test_w8a16_practice_is_unchanged() -> None:
    weight = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    assert preset_config("W8A16") == {
        "apiversion": "modelslim_v1",
        "metadata": {"config_id": "default-w8a16", "label": {"w_bit": 8, "a_bit": 16}},
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}}],
            "save": [{"type": "ascendv1_saver", "part_file_size": 4}],
        },
    }


class _SmoothStandIn(ProcessorConfig):
    type: Literal["iter_smooth"] = "iter_smooth"
    include: list[str] = ["*"]


class SmoothStandIn(Processor):
    """Stands in for ``iter_smooth`` where it is not installed (only its schema matters here)."""

    type_name = "iter_smooth"
    config_class = _SmoothStandIn


def test_w8a8_is_msmodelslims_default_w8a8_practice() -> None:
    default = msquant.plugin.default_registry()
    names = [n for n in default.names() if n != "iter_smooth"]
    registry = msquant.plugin.ProcessorRegistry([default.get(n) for n in names] + [SmoothStandIn])
    config = preset_config("w8a8", registry)
    assert config["metadata"]["config_id"] == "default-w8a8"
    smooth, linear = config["spec"]["process"]
    assert smooth == {"type": "iter_smooth", "include": ["*"]}
    per_token = {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"}
    int8 = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    assert linear == {
        "type": "linear_quant", "qconfig": {"act": per_token, "weight": int8}, "include": ["*"]
    }  # fmt: skip


@pytest.mark.skipif(HAS_ITER_SMOOTH, reason="iter_smooth is installed")
def test_w8a8_without_iter_smooth_is_refused_naming_it(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out", "--quant_type", "w8a8"
    )
    assert result.code == 2
    assert "--quant_type w8a8 (msquant/data/practices/w8a8.yaml)" in result.err
    assert "spec.process[0].type: unknown processor type 'iter_smooth'" in result.err
    assert "Traceback" not in result.err
    assert not (tmp_path / "out").exists()


def test_family_practices_are_msquants_w8a8_for_llama_and_gemma3() -> None:
    """msquant's own best practices (msModelSlim ships none for these families): the layout of
    msModelSlim's W8A8 family practices, dense down_proj float, smoothing norm-linear and ov."""
    assert FAMILY_PRACTICES == {
        ("w8a8", "gemma3_text"): "w8a8-gemma3_text.yaml",
        ("w8a8", "llama"): "w8a8-llama.yaml",
    }
    per_token = {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"}
    int8 = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    for model_type, config_id in (
        ("gemma3_text", "msquant-gemma3-w8a8"),
        ("llama", "msquant-llama-w8a8"),
    ):
        config = preset_config("W8A8", model_type=model_type)
        assert config["metadata"]["config_id"] == config_id
        assert config["metadata"]["verified_model_types"] == [model_type]
        smooth, linear = config["spec"]["process"]
        assert smooth == {
            "type": "iter_smooth",
            "enable_subgraph_type": ["norm-linear", "ov"],
            "include": ["*"],
        }
        assert linear == {
            "type": "linear_quant",
            "qconfig": {"act": per_token, "weight": int8},
            "include": ["*"],
            "exclude": ["*mlp.down_proj"],
        }
    # every other family, and the other values, get the default practice
    assert preset_config("w8a8", model_type="qwen3")["metadata"]["config_id"] == "default-w8a8"
    assert preset_config("w8a16", model_type="llama")["metadata"]["config_id"] == "default-w8a16"


@pytest.mark.skipif(not HAS_ITER_SMOOTH, reason="needs the iter_smooth processor")
def test_w8a8_runs_llamas_family_practice_and_msmodelslims_default_with_model_type(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    args = ("--quant_type", "w8a8", "--calib_path", CALIB_TXT, "--no_progress")
    result = run_cli("quant", "--model_path", tiny_llama, "--save_path", tmp_path / "own", *args)
    assert result.code == 0, result.err
    assert "msquant's best practice for model_type 'llama' (w8a8-llama.yaml" in result.err
    types = description(tmp_path / "own")
    assert types["model.layers.0.mlp.down_proj.weight"] == "FLOAT"
    assert types["model.layers.0.mlp.up_proj.weight"] == "W8A8_DYNAMIC"
    # naming msModelSlim's adapter gets msModelSlim's choice: its default practice
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "default",
        "--model_type", "default", *args,
    )  # fmt: skip
    assert result.code == 0, result.err
    assert "best practice" not in result.err
    types = description(tmp_path / "default")
    assert types["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"


@pytest.mark.skipif(not HAS_ITER_SMOOTH, reason="needs the iter_smooth processor")
def test_w8a8_on_gemma3_plans_its_family_practice(
    tiny_model_factory: Callable[..., Path], run_cli: Callable[..., Any]
) -> None:
    model_dir = tiny_model_factory("gemma3_text", num_layers=1)
    result = run_cli("plan", "--model_path", model_dir, "--quant_type", "w8a8", "--json")
    assert result.code == 0, result.err
    rows = {row["module"]: row for row in json.loads(result.out)["rows"]}
    assert rows["model.layers.0.mlp.down_proj"]["skipped"] is True
    assert rows["model.layers.0.mlp.gate_proj"]["act"] == "W8A8_DYNAMIC"


def test_w4a8_on_a_dense_model_is_w8a8_dynamic_throughout(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "W4A8", "--tag", "vllm", "Atlas_A2_Inference", "--no_progress",
    )  # fmt: skip
    assert result.code == 0, result.err
    types = description(tmp_path / "out")
    linear = {k: v for k, v in types.items() if k.endswith("proj.weight")}
    assert len(linear) == 14 and set(linear.values()) == {"W8A8_DYNAMIC"}
    assert "--tag vllm Atlas_A2_Inference: accepted" in result.err
    assert "*mlp.experts*" in result.err  # the experts pattern matches nothing here: warned


@NEEDS_MOE_TRANSFORMERS
def test_w4a8_puts_int4_weights_on_the_moe_experts(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    model_dir = tiny_model_factory("qwen3_moe", num_layers=2)
    result = run_cli(
        "quant", "--model_path", model_dir, "--save_path", tmp_path / "out",
        "--quant_type", "w4a8", "--no_progress",
    )  # fmt: skip
    assert result.code == 0, result.err
    types = description(tmp_path / "out")
    assert types["model.layers.0.mlp.experts.3.down_proj.weight"] == "W4A8_DYNAMIC"
    assert types["model.layers.0.self_attn.q_proj.weight"] == "W8A8_DYNAMIC"
    assert types["model.layers.0.mlp.gate.weight"] == "FLOAT"


def test_unimplemented_quant_type_exits_2(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "w8a8c8",
    )  # fmt: skip
    assert result.code == 2
    assert "quant_type 'w8a8c8' is one of msModelSlim's but msquant does not implement it" in (
        result.err
    )
    assert not (tmp_path / "out").exists()
