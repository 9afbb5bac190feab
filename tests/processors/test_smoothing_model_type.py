"""``--model_type`` (``quantize(model_type=...)``): the smoothing processors smooth the subgraph
types msModelSlim 26.1.0's model adapter of that name lets them smooth (its ``default`` adapter
and the Qwen2 / Qwen2.5 ones: norm-linear only; Qwen3's: norm-linear, ov, up-down; QwQ's
``iter_smooth``: norm-linear and up-down), as msModelSlim reads the same YAML; without it,
every type msquant's adapter finds. tests/oracle checks the exports against msModelSlim's."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CALIB_TXT
from safetensors.torch import load_file

import msquant
from msquant.processors.smoothing.msmodelslim_adapters import msmodelslim_types
from msquant.run.checkpoint.fingerprint import fingerprint_differences, run_fingerprint

W8A8_DYNAMIC = {
    "type": "linear_quant",
    "qconfig": {
        "act": {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"},
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"},
    },
}
ALL = ["norm-linear", "linear-linear", "ov", "up-down"]


def cfg(smoothing: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": [copy.deepcopy(smoothing), copy.deepcopy(W8A8_DYNAMIC)]},
    }


def weights(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


def run(model: Path, out: Path, smoothing: dict[str, Any], **options: Any) -> dict[str, Any]:
    msquant.quantize(model, out, cfg(smoothing), calib_path=CALIB_TXT, progress=False, **options)
    return weights(out)


@pytest.mark.parametrize(
    ("processor", "model_type", "types"),
    [
        ("iter_smooth", "default", ("norm-linear",)),
        ("flex_smooth_quant", "default", ("norm-linear",)),
        ("iter_smooth", "Qwen2.5-7B-Instruct", ("norm-linear",)),  # no smoothing interface
        ("iter_smooth", "Qwen2-7B", ("norm-linear",)),  # its subgraphs serve AWQ only
        ("iter_smooth", "Qwen3-8B", ("norm-linear", "ov", "up-down")),
        ("flex_smooth_quant", "Qwen3-30B", ("norm-linear", "ov", "up-down")),
        ("iter_smooth", "QwQ-32B", ("norm-linear", "up-down")),
        ("flex_smooth_quant", "QwQ-32B", ("norm-linear",)),  # no FlexSmoothQuantInterface
        ("iter_smooth", "DeepSeek-V3.2", ("norm-linear",)),
        ("flex_smooth_quant", "DeepSeek-V3.2", ("norm-linear", "ov", "up-down")),
        ("flex_smooth_quant", "DeepSeek-V4-Pro", ("norm-linear", "up-down", "linear-linear")),
        ("flex_smooth_quant", "GLM-4.7", ("norm-linear", "ov")),
        ("iter_smooth", "Qwen3-Next-80B-A3B-Instruct", ("norm-linear",)),
        ("smooth_quant", "Qwen3-8B", ("norm-linear",)),
        ("iter_smooth", "Llama-3-8B", ("norm-linear",)),  # unknown: msModelSlim's default
    ],
)
def test_msmodelslim_adapter_types(processor: str, model_type: str, types: tuple[str]) -> None:
    assert msmodelslim_types(processor, model_type) == types


def test_model_type_default_smooths_norm_linear_subgraphs_only(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """msModelSlim's default-w8a8 practice (iter_smooth, every type enabled) under
    ``--model_type default`` smooths what ``enable_subgraph_type: [norm-linear]`` smooths."""
    smoothing = {"type": "iter_smooth", "enable_subgraph_type": ALL}
    with caplog.at_level("INFO", logger="msquant.processors.smoothing.msmodelslim_adapters"):
        default = run(tiny_llama, tmp_path / "default", smoothing, model_type="default")
    norm_only = run(
        tiny_llama, tmp_path / "norm", {**smoothing, "enable_subgraph_type": ["norm-linear"]}
    )
    everything = run(tiny_llama, tmp_path / "all", smoothing)
    assert [n for n in default if not torch.equal(default[n], norm_only[n])] == []
    changed = [n for n in default if not torch.equal(default[n], everything[n])]
    assert "model.layers.0.mlp.down_proj.weight" in changed  # up-down: smoothed without
    assert "model.layers.0.self_attn.o_proj.weight" in changed  # ov: smoothed without
    assert (
        "--model_type default (msModelSlim's default adapter): iter_smooth smooths norm-linear "
        "subgraphs (not up-down, ov, linear-linear)" in caplog.text
    )


def test_model_type_qwq_smooths_norm_linear_and_up_down(tiny_llama: Path, tmp_path: Path) -> None:
    smoothing = {"type": "iter_smooth", "alpha": 0.9}
    qwq = run(tiny_llama, tmp_path / "qwq", smoothing, model_type="QwQ-32B")
    expected = run(
        tiny_llama,
        tmp_path / "expected",
        {**smoothing, "enable_subgraph_type": ["norm-linear", "up-down"]},
    )
    assert [n for n in qwq if not torch.equal(qwq[n], expected[n])] == []


def test_unknown_model_type_falls_back_to_the_default_adapter_with_a_warning(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    smoothing = {"type": "flex_smooth_quant", "alpha": 0.6, "beta": 0.4}
    with caplog.at_level("WARNING"):
        unknown = run(tiny_llama, tmp_path / "unknown", smoothing, model_type="Llama-3-8B")
    default = run(tiny_llama, tmp_path / "default", smoothing, model_type="default")
    assert [n for n in unknown if not torch.equal(unknown[n], default[n])] == []
    assert (
        "--model_type Llama-3-8B is not one of msModelSlim 26.1.0's model adapters msquant "
        "knows; msModelSlim falls back to its default adapter for such a name, so "
        "flex_smooth_quant smooths norm-linear subgraphs only, as there" in caplog.text
    )


def test_nothing_left_to_smooth_under_the_model_type_is_refused(
    tiny_llama: Path, tmp_path: Path
) -> None:
    smoothing = {"type": "iter_smooth", "enable_subgraph_type": ["ov", "up-down"]}
    with pytest.raises(msquant.QuantizationError) as info:
        run(tiny_llama, tmp_path / "out", smoothing, model_type="default")
    assert str(info.value) == (
        "iter_smooth: no subgraph to smooth under --model_type default: msModelSlim 26.1.0's "
        "adapter for that name lets iter_smooth smooth norm-linear subgraphs, and the entry asks "
        "for up-down, ov (include ['*'], exclude []), so msModelSlim would smooth nothing; name "
        "other types, or drop the entry"
    )
    assert not (tmp_path / "out").exists()


def test_cli_model_type_reaches_the_smoothing(
    tiny_llama: Path, tmp_path: Path, run_cli: Any
) -> None:
    config = tmp_path / "iter.yaml"
    config.write_text(json.dumps(cfg({"type": "iter_smooth"})), encoding="utf-8")
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "cli",
        "--config_path", config, "--calib_path", CALIB_TXT, "--model_type", "default",
        "--no_progress",
    )  # fmt: skip
    assert result.code == 0, result.err
    expected = run(
        tiny_llama,
        tmp_path / "norm",
        {"type": "iter_smooth", "enable_subgraph_type": ["norm-linear"]},
    )
    cli = weights(tmp_path / "cli")
    assert [n for n in cli if not torch.equal(cli[n], expected[n])] == []


def test_a_resumed_run_must_name_the_same_model_type(tmp_path: Path) -> None:
    common = dict(
        config_sha256="c", calibration_sha256="d", model_dir=tmp_path, device_kind="cpu",
        num_layers=2,
    )  # fmt: skip
    then = run_fingerprint(**common)  # type: ignore[arg-type]
    now = run_fingerprint(**common, model_type="default")  # type: ignore[arg-type]
    assert fingerprint_differences(then, now) == [
        "--model_type (msModelSlim model adapter): None then, default now"
    ]
    assert fingerprint_differences(then, run_fingerprint(**common)) == []  # type: ignore[arg-type]
