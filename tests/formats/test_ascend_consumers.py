"""Ascend exports and vLLM-Ascend (issue 13, section 1, items 10 and 11).

vLLM-Ascend loads per-channel W8A16 linear layers; it has no W4A16 linear scheme, no per-group
W8A16 and no W8A16 MoE scheme, and passes an asymmetric ``weight_offset`` unchanged to a kernel
documented as ``(weight + offset) * scale`` while the format means ``(weight - offset) * scale``.
The savers warn about each, naming vLLM-Ascend, from the plan: before any weight is loaded (the
model folders here hold no usable weights) and in ``msquant plan``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import EXAMPLES, NEEDS_MOE_TRANSFORMERS
from safetensors.torch import save_file

import msquant
import msquant.plugin
import msquant.plugin.planning

SAVERS = ("ascendv1_saver", "mindie_format_saver")


def _weight(bits: int, group_size: int | None = None, sym: bool = True) -> dict[str, Any]:
    weight: dict[str, Any] = {
        "dtype": f"int{bits}",
        "scope": "per_channel" if group_size is None else "per_group",
        "symmetric": sym,
        "method": "minmax",
    }
    if group_size is not None:
        weight["ext"] = {"group_size": group_size}
    return weight


def _config(weight: dict[str, Any], saver: str = "ascendv1_saver", **entry: Any) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}, **entry}],
            "save": [{"type": saver}],
        },
    }


def _weightless(model: Path, folder: Path) -> Path:
    """``model``'s config beside a weights file holding none of its tensors."""
    folder.mkdir()
    shutil.copy(model / "config.json", folder / "config.json")
    save_file({"unrelated": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


def _vllm_ascend(warnings: list[str], saver: str = "ascendv1_saver") -> list[str]:
    return [w for w in warnings if w.startswith(f"{saver}: ") and "vLLM-Ascend" in w]


@pytest.fixture(scope="module")
def weightless(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _weightless(tiny_llama, tmp_path_factory.mktemp("ascend") / "model")


# --- item 10: the offset sign of asymmetric W8A16 --------------------------------------------------


@pytest.mark.parametrize("saver", SAVERS)
def test_asymmetric_export_warns_about_the_offset_sign_in_the_plan(
    saver: str, weightless: Path
) -> None:
    plan = msquant.plugin.planning.build_plan(weightless, _config(_weight(8, sym=False), saver))
    [warning] = _vllm_ascend(plan.warnings, saver)
    assert "npu_weight_quant_batchmatmul" in warning
    assert "(weight + offset) * scale" in warning and "(weight - offset) * scale" in warning
    assert "symmetric: true" in warning and "model.layers.0.self_attn.q_proj" in warning
    assert plan.ok  # a warning: MindIE reads the offsets as written


class _WeightsLoaded(Exception):
    """Raised where a run would start loading weights."""


def _refuse_loading(*args: object, **kwargs: object) -> None:
    raise _WeightsLoaded


def test_the_offset_warning_comes_before_weights_load_and_in_msquant_plan(
    weightless: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    run_cli: Callable[..., Any],
) -> None:
    config = _config(_weight(8, sym=False))
    monkeypatch.setattr("msquant.run.steps.load_for_run", _refuse_loading)
    with caplog.at_level(logging.WARNING), pytest.raises(_WeightsLoaded):
        msquant.quantize(weightless, tmp_path / "out", config, progress=False)
    assert _vllm_ascend([r.getMessage() for r in caplog.records])
    path = tmp_path / "asym.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    result = run_cli("plan", "--model_path", weightless, "--config_path", path)
    assert result.code == 0, result.err
    assert "npu_weight_quant_batchmatmul" in result.out


def test_symmetric_per_channel_w8a16_has_no_vllm_ascend_warning(weightless: Path) -> None:
    for config in (_config(_weight(8)), _config(_weight(8), "mindie_format_saver")):
        assert (
            _vllm_ascend(msquant.plugin.planning.build_plan(weightless, config).warnings, "") == []
        )
    plan = msquant.plugin.planning.build_plan(weightless, _config(_weight(8), lm_head=True))
    assert not [w for w in plan.warnings if "vLLM-Ascend" in w]


@pytest.mark.parametrize(
    "example",
    [
        "w8a16_per_channel_asym_minmax.yaml",
        "w8a16_per_group_asym_minmax_skip_down.yaml",
        "w8a16_per_group64_gptq_asym.yaml",
    ],
)
def test_asymmetric_examples_say_which_consumer_they_are_for(example: str) -> None:
    text = (EXAMPLES / example).read_text(encoding="utf-8")
    comments = " ".join(line for line in text.splitlines() if line.startswith("#"))
    assert "For MindIE" in comments and "vLLM-Ascend" in comments
    assert "(weight + offset) * scale" in comments


# --- item 11: what vLLM-Ascend has no scheme for -------------------------------------------------


def test_w4a16_linear_layers_warn_before_weights_load(weightless: Path) -> None:
    [warning] = _vllm_ascend(
        msquant.plugin.planning.build_plan(weightless, _config(_weight(4, 32))).warnings
    )
    assert warning.startswith("ascendv1_saver: vLLM-Ascend has no W4A16 linear scheme")
    assert "dtype: int8" in warning


def test_per_group_w8a16_warns_before_weights_load(weightless: Path) -> None:
    config = _config(_weight(8, 32), exclude=["*down_proj"])
    [warning] = _vllm_ascend(msquant.plugin.planning.build_plan(weightless, config).warnings)
    assert "per-channel only" in warning and "scope: per_channel" in warning
    assert "model.layers.0.self_attn.q_proj" in warning and "and 8 more" in warning  # 12 layers


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_moe_experts_warn_before_weights_load(
    bits: int, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = _weightless(tiny_model_factory("qwen3_moe", num_layers=2), tmp_path / "moe")
    weight = _weight(8) if bits == 8 else _weight(4, 32)
    warnings = _vllm_ascend(msquant.plugin.planning.build_plan(model, _config(weight)).warnings)
    [experts] = [w for w in warnings if "MoE experts" in w]
    assert "no W8A16 scheme for MoE layers" in experts and "mlp.experts.0.gate_proj" in experts
    assert "self_attn" not in experts
    kept_float = _config(weight, exclude=["*.experts.*"])
    again = _vllm_ascend(msquant.plugin.planning.build_plan(model, kept_float).warnings)
    assert not [w for w in again if "MoE experts" in w]


def test_ascend_format_doc_lists_every_warning() -> None:
    text = (EXAMPLES.parent / "docs" / "ascend-format.md").read_text(encoding="utf-8")
    for row in ("W8A16 per-group", "W4A16 (`dtype: int4`)", "quantized MoE experts",
                "W8A16 asymmetric"):  # fmt: skip
        assert f"| {row}" in text, row
    assert "warns, before any weight is loaded" in text
