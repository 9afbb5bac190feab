"""``dynamic_cache`` (int8 KV cache, C8) and ``pd_mix`` activations (W8A8_MIX) on tiny models:
the KV scales against a float64 reference computed from the cached states themselves, the export
read back, and the refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from activation_cases import WEIGHT, act
from conftest import CALIB_TXT
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import msquant
from msquant import ConfigError, QuantizationError, load_config_text, verify_export
from msquant.load.calibration import read_calibration_texts
from msquant.plugin import default_registry
from msquant.plugin.planning import build_plan
from msquant.processors.kv_cache_quant import kv_channels

C8 = {
    "type": "dynamic_cache",
    "qconfig": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
    "include": ["*"],
}


def _config(act_cfg: dict[str, Any], *cache: dict[str, Any], saver: str = "ascendv1_saver") -> dict:
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {"type": "linear_quant", "qconfig": {"act": act_cfg, "weight": WEIGHT}},
                *cache,
            ],
            "save": [{"type": saver, "part_file_size": 0}],
        },
    }


def _run(model: Path, out: Path, cfg: dict) -> None:
    msquant.quantize(model, out, cfg, calib_path=CALIB_TXT, progress=False)


def test_c8_scales_are_the_float64_range_of_the_cached_states(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Float activations and int8 weights: the stored scales equal ``max|x| / 127`` per channel
    over every calibration token, computed in float64 from the keys (after k_norm and RoPE) and
    values that transformers' DynamicCache receives in the model with the export's dequantized
    weights (the layers are observed as quantized)."""
    model_dir = tiny_model_factory("qwen3")
    out = tmp_path / "out"
    cfg = _config(
        {"dtype": "float", "scope": "per_tensor", "symmetric": True, "method": "none"}, C8
    )
    _run(model_dir, out, cfg)
    tensors = load_file(str(out / "quant_model_weights.safetensors"))
    description = (out / "quant_model_description.json").read_text()
    assert '"kv_cache_type": "C8"' in description and '"kv_quant_type": "C8"' in description

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, module in model.named_modules():
        if f"{name}.weight_scale" in tensors:
            codes, scale = (
                tensors[f"{name}.weight"].double(),
                tensors[f"{name}.weight_scale"].double(),
            )
            module.weight.data = (codes * scale).float()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = read_calibration_texts(CALIB_TXT)
    keys: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        for index, layer in enumerate(cache.layers):
            keys.setdefault(index, []).append(kv_channels(layer.keys).double())
            values.setdefault(index, []).append(kv_channels(layer.values).double())
    caches = json.loads((out / "quant_report.json").read_text())["kv_caches"]
    assert [c["name"] for c in caches] == [f"model.layers.{i}.self_attn" for i in sorted(keys)]
    for index, cache in zip(sorted(keys), caches, strict=True):
        assert cache["scheme"] == "C8" and cache["channels"] == keys[index][0].shape[1]
        assert cache["tokens"] == sum(k.shape[0] for k in keys[index])
        assert cache["tensors"] == [
            f"model.layers.{index}.self_attn.{part}.kv_cache_{what}"
            for part in ("k_proj", "v_proj")
            for what in ("scale", "offset")
        ]
        for field, states in (("key_absmax", keys[index]), ("value_absmax", values[index])):
            assert cache[field] == pytest.approx(torch.cat(states).abs().max().item(), rel=1e-6)
    for index in keys:
        for part, states in (("k_proj", keys[index]), ("v_proj", values[index])):
            rows = torch.cat(states)
            expected = rows.abs().amax(dim=0).clamp_min(torch.finfo(torch.float32).eps) / 127
            stored = tensors[f"model.layers.{index}.self_attn.{part}.kv_cache_scale"]
            assert stored.dtype == torch.float32 and stored.shape == expected.shape
            torch.testing.assert_close(stored.double(), expected, rtol=2e-6, atol=0)
            assert not tensors[f"model.layers.{index}.self_attn.{part}.kv_cache_offset"].any()
    assert verify_export(out).ok


def test_c8_with_w8a8_dynamic_and_pd_mix_exports_verify(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3")
    for name, act_cfg in (
        ("dynamic", act("per_token", True)),
        ("pd_mix", act("pd_mix", False)),
    ):
        out = tmp_path / name
        _run(model_dir, out, _config(act_cfg, C8))
        report = verify_export(out)
        assert report.ok, report
        tensors = load_file(str(out / "quant_model_weights.safetensors"))
        kv = sorted(k for k in tensors if "kv_cache" in k)
        assert len(kv) == 8
    mix = load_file(str(tmp_path / "pd_mix" / "quant_model_weights.safetensors"))
    layer = "model.layers.0.mlp.down_proj"
    assert {k.rpartition(".")[2] for k in mix if k.startswith(layer + ".")} == {
        "weight",
        "quant_bias",
        "input_scale",
        "input_offset",
        "deq_scale",
        "weight_scale",
        "weight_offset",
    }
    # float32 model: deq_scale holds the float32 bits of input_scale * weight_scale as int64
    deq = mix[f"{layer}.deq_scale"].to(torch.int32).view(torch.float32)
    assert torch.equal(deq, mix[f"{layer}.weight_scale"].reshape(-1) * mix[f"{layer}.input_scale"])


def test_plan_and_report_name_the_c8_attentions(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """``msquant plan`` says which attentions get C8 (an excluded one stays float); the run
    report lists the quantized caches (their rendering: tests/planning, tests/report)."""
    model_dir = tiny_model_factory("qwen3")
    cfg = _config(act("per_token", True), dict(C8, exclude=["model.layers.1.*"]))
    plan = build_plan(model_dir, cfg)
    assert [(c.module, c.scheme, c.decided_by) for c in plan.kv_caches] == [
        ("model.layers.0.self_attn", "C8", "spec.process[1]"),
        ("model.layers.1.self_attn", None, "spec.process[1]"),
    ]
    assert plan.to_dict()["kv_caches"][1] == {
        "module": "model.layers.1.self_attn",
        "scheme": None,
        "decided_by": "spec.process[1]",
    }
    out = tmp_path / "out"
    _run(model_dir, out, cfg)
    tensors = load_file(str(out / "quant_model_weights.safetensors"))
    assert sorted(k for k in tensors if "kv_cache" in k and ".1." in k) == []
    data = json.loads((out / "quant_report.json").read_text())
    assert [c["name"] for c in data["kv_caches"]] == ["model.layers.0.self_attn"]


def test_refusals(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    bad = dict(C8, qconfig={**C8["qconfig"], "scope": "per_tensor"})
    with pytest.raises(ConfigError, match="only per_channel is supported"):
        load_config_text(
            __import__("yaml").safe_dump(_config(act("per_token", True), bad)), default_registry()
        )
    with pytest.raises(ConfigError, match="pd_mix.*not implemented"):
        load_config_text(
            __import__("yaml").safe_dump(_config(act("pd_mix", True))), default_registry()
        )
    model_dir = tiny_model_factory("qwen3")
    with pytest.raises(QuantizationError, match="mindie_format_saver: .*C8 tensor"):
        _run(
            model_dir,
            tmp_path / "m",
            _config(act("per_token", True), C8, saver="mindie_format_saver"),
        )


def test_unknown_architecture_is_refused(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """An architecture without a KV-cache adapter is refused, the layer named, before weights load."""
    model_dir = tiny_model_factory("mistral")
    with pytest.raises(
        QuantizationError, match=r"model.layers.0: msquant does not know where model_type 'mistral'"
    ):
        _run(model_dir, tmp_path / "x", _config(act("per_token", True), C8))
