"""MoE models through the whole pipeline: experts split into per-expert linear layers, GPTQ per
expert on the tokens routed to it, experts with too few tokens rounded to nearest and listed in
the report, exports under the checkpoint's own per-expert names."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS
from safetensors import safe_open

import msquant
from msquant.calibration import read_calibration_texts, tokenize_samples
from msquant.errors import ModelLoadError
from msquant.model.capture import batch_samples
from msquant.model.loader import load_causal_lm, load_tokenizer
from msquant.model.moe import ExpertTokenCounter, unfuse_experts

pytestmark = NEEDS_MOE_TRANSFORMERS

MAX_TOKENS = 24


def _config(runner: str, ratio: float) -> dict[str, Any]:
    weight = {
        "scope": "per_group",
        "dtype": "int8",
        "symmetric": True,
        "method": "gptq",
        "ext": {"group_size": 32, "expert_min_tokens": ratio},
    }
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "runner": runner,
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}}],
            "save": [{"type": "ascendv1_saver"}],
        },
    }


def _quantize(model: Path, save: Path, config: dict[str, Any]) -> Any:
    return msquant.quantize(
        model, save, config, calib_path=CALIB_TXT, max_calib_tokens=MAX_TOKENS, progress=False
    )


def _expert_tokens(model_dir: Path) -> dict[str, int]:
    """Tokens routed to every expert linear in a plain forward of the float model (the runner
    calibrates each layer on the float model's activations, so the routing is the same)."""
    model = load_causal_lm(model_dir)
    unfuse_experts(model)
    samples = tokenize_samples(
        read_calibration_texts(CALIB_TXT), load_tokenizer(model_dir), MAX_TOKENS
    )
    with ExpertTokenCounter(model) as counter, torch.no_grad():
        for batch in batch_samples(samples):
            model(input_ids=batch)
    return counter.counts


@pytest.fixture(scope="module")
def qwen3_moe(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("qwen3_moe", num_layers=2)


def test_experts_are_solved_or_rounded_by_their_token_counts(
    qwen3_moe: Path, tmp_path: Path
) -> None:
    counts = _expert_tokens(qwen3_moe)
    # a ratio that puts half of the experts' gate/up (in_features 64) below the threshold
    gate = sorted(n for name, n in counts.items() if name.endswith("gate_proj"))
    ratio = (gate[len(gate) // 2] + 0.5) / 64
    result = _quantize(qwen3_moe, tmp_path / "out", _config("layer_wise", ratio))
    modules = {m.name: m for m in result.report.modules}
    experts = [name for name in modules if ".experts." in name]
    assert len(experts) == 2 * 8 * 3  # every expert's gate/up/down in both layers
    fallbacks = {name for name in experts if modules[name].fallback is not None}
    for name in experts:
        in_features = 64 if not name.endswith("down_proj") else 32
        assert modules[name].tokens == counts[name], name
        expected_rtn = counts[name] == 0 or counts[name] < ratio * in_features
        assert (name in fallbacks) == expected_rtn, (name, counts[name])
        if expected_rtn:
            assert modules[name].method == "gptq" and modules[name].gptq_loss is None
            assert f"received {counts[name]} calibration token(s)" in modules[name].fallback
        else:
            assert modules[name].gptq_loss is not None
    assert 0 < len(fallbacks) < len(experts)
    report = json.loads((tmp_path / "out" / "quant_report.json").read_text())
    assert {m["name"] for m in report["modules"] if m["fallback"]} == fallbacks


def test_export_uses_the_checkpoints_per_expert_names(qwen3_moe: Path, tmp_path: Path) -> None:
    _quantize(qwen3_moe, tmp_path / "out", _config("layer_wise", 2.0))
    export = read_ascend_export(tmp_path / "out")
    with safe_open(str(qwen3_moe / "model.safetensors"), framework="pt") as handle:
        original = set(handle.keys())
    quantized = set(export.quantized_modules())
    weights = {n for n in export.tensors if not n.endswith(("weight_scale", "weight_offset"))}
    assert weights == original  # every tensor under the name the checkpoint (and vLLM) uses
    assert "model.layers.1.mlp.experts.7.down_proj" in quantized
    assert export.description["model.layers.1.mlp.experts.7.down_proj.weight"] == "W8A16"
    assert export.description["model.layers.1.mlp.gate.weight"] == "FLOAT"  # the router


def test_streamed_moe_run_equals_the_whole_model_run(qwen3_moe: Path, tmp_path: Path) -> None:
    _quantize(qwen3_moe, tmp_path / "streamed", _config("layer_wise", 2.0))
    _quantize(qwen3_moe, tmp_path / "whole", _config("model_wise", 2.0))
    for name in ("quant_model_weights.safetensors", "quant_model_description.json"):
        streamed = sorted((tmp_path / "streamed").glob(name.replace(".", "*.", 1)))
        whole = sorted((tmp_path / "whole").glob(name.replace(".", "*.", 1)))
        assert [p.name for p in streamed] == [p.name for p in whole] and streamed
        for a, b in zip(streamed, whole, strict=True):
            assert a.read_bytes() == b.read_bytes(), a.name


def test_mixtral_style_names_are_refused(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:

    model = tiny_model_factory("mixtral", num_layers=1, intermediate_size=32)
    with pytest.raises(
        ModelLoadError, match=r"mlp\.gate\.weight -> .*block_sparse_moe.* not supported"
    ):
        _quantize(model, tmp_path / "out", _config("layer_wise", 2.0))
    assert not (tmp_path / "out").exists()
