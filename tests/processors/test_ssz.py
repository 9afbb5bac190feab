"""``method: ssz``: msModelSlim's SSZ weight quantization (per-channel scales searched by least
squares). The numerics against a float64 transcription of the search, the validation of its
``ext``, and a run through ``linear_quant`` and the Ascend export. The comparison with msModelSlim's
own quantizer is in tests/oracle/test_ssz_oracle.py (opt-in)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import msquant
import msquant.plugin.numerics
from msquant.processors.methods.ssz_search import DEFAULT_STEPS, ssz_codes, ssz_scales
from msquant.quant.int_quant import dequantize


def reference(weight: torch.Tensor, bits: int, steps: int) -> tuple[torch.Tensor, int]:
    """The search in float64, row by row over ``[out, in]``: the kept scales and the number of
    steps run (written from the method's description, not from the implementation)."""
    w = weight.double()
    qmax = 2 ** (bits - 1) - 1

    def codes_of(scale: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(w / scale[:, None]), -qmax - 1, qmax)

    def error(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return ((w - q * scale[:, None]) ** 2).mean(dim=1)

    scale = (w.abs().amax(dim=1) / qmax).clamp(min=torch.finfo(torch.float32).eps)
    kept, q = scale.clone(), codes_of(scale)
    kept_error = error(q, scale)
    for step in range(steps):
        scale = (w * q).sum(dim=1) / (q * q).sum(dim=1).clamp(min=1e-30)
        q = codes_of(scale)
        now = error(q, scale)
        moved = ((kept_error - now) / kept_error.clamp(min=1e-4) >= 1e-10) & (
            (kept_error - now).abs() >= 1e-10
        )
        if not moved.any():
            return kept, step
        better = now < kept_error
        kept = torch.where(better, scale, kept)
        kept_error = torch.where(better, now, kept_error)
    return kept, steps


def weights(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 96, generator=g)
    w[0, 5] = 12.0  # an outlier: min/max wastes most of the grid on it
    w[1] *= 1e-3
    return w


@pytest.mark.parametrize("bits", [8, 4])
def test_scales_match_a_float64_search(bits: int) -> None:
    w = weights(bits)
    ours = ssz_scales(w, bits)
    theirs, _ = reference(w, bits, DEFAULT_STEPS)
    assert ours.dtype == torch.float32 and ours.shape == (48,)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=0)
    codes = ssz_codes(w.t(), ours, bits).t()
    expected = torch.clamp(
        torch.round(w.double() / theirs[:, None]), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    )
    assert (codes.double() != expected).float().mean() < 1e-3  # ties may round apart


@pytest.mark.parametrize("bits", [8, 4])
def test_ssz_never_loses_to_minmax_and_usually_wins(bits: int) -> None:
    w = weights(10 + bits)
    minmax = msquant.plugin.numerics.quantize_weight_minmax(w, bits, True)
    rtn = dequantize(minmax.codes, minmax.scale, minmax.offset, None)
    scale = ssz_scales(w, bits)
    ssz = ssz_codes(w.t(), scale, bits).t() * scale[:, None]
    rtn_error = ((w - rtn) ** 2).mean(dim=1)
    ssz_error = ((w - ssz) ** 2).mean(dim=1)
    assert bool((ssz_error <= rtn_error * (1 + 1e-6)).all())
    assert (ssz_error < rtn_error).float().mean() > 0.9
    assert ssz_error[0] < rtn_error[0]  # the outlier row too


def test_step_bounds_the_search_and_zero_means_the_default() -> None:
    w = weights(3)
    _, ran = reference(w, 4, DEFAULT_STEPS)
    assert ran > 2  # the search takes several steps on this weight
    one = ssz_scales(w, 4, steps=1)
    torch.testing.assert_close(one.double(), reference(w, 4, 1)[0], rtol=1e-5, atol=0)
    assert not torch.equal(one, ssz_scales(w, 4))


def test_zero_rows_keep_the_floor_scale() -> None:
    w = weights(4)
    w[2] = 0.0
    scale = ssz_scales(w, 8)
    assert scale[2] == torch.finfo(torch.float32).eps
    assert bool(torch.isfinite(scale).all())


def config(weight: dict[str, Any], **entry: Any) -> dict[str, Any]:
    qconfig = {"weight": {"scope": "per_channel", "symmetric": True, "method": "ssz", **weight}}
    return {"spec": {"process": [{"type": "linear_quant", "qconfig": qconfig, **entry}]}}


def errors(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(msquant.ConfigError) as info:
        msquant.validate_config(data, msquant.plugin.default_registry())
    return {issue.path: issue.message for issue in info.value.issues}


def test_ssz_validation() -> None:
    registry = msquant.plugin.default_registry()
    msquant.validate_config(config({"dtype": "int4", "ext": {"step": 10}}), registry)
    w = "spec.process[0].qconfig.weight"
    assert errors(config({"dtype": "int8", "symmetric": False}))[f"{w}.symmetric"].startswith(
        "method ssz is symmetric only"
    )
    assert (
        "implemented (dtype, scope): (int4, per_channel), (int8, per_channel)"
        in errors(config({"dtype": "int8", "scope": "per_group"}))[w]
    )
    assert errors(config({"dtype": "int8", "ext": {"step": -1}}))[f"{w}.ext.step"].startswith(
        "Input should be greater than or equal to 0"
    )
    assert errors(config({"dtype": "int8", "ext": {"steps": 5}}))[f"{w}.ext.steps"] == (
        "unknown ssz option; valid: step, group_size"
    )


def test_group_size_beside_per_channel_is_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """msModelSlim's qwen3-30b W4A8 practice writes ext.group_size: 64 with scope per_channel."""
    caplog.set_level(logging.WARNING)
    msquant.validate_config(
        config({"dtype": "int4", "ext": {"group_size": 64}}), msquant.plugin.default_registry()
    )
    assert "qconfig.weight.ext.group_size is ignored with scope per_channel" in caplog.text


def test_ssz_through_linear_quant_and_the_ascend_export(tiny_llama: Path, tmp_path: Path) -> None:
    data = config({"dtype": "int8"}, exclude=["*down_proj"])
    result = msquant.quantize(tiny_llama, tmp_path / "out", data, progress=False)
    assert len(result.quantized_modules) == 12
    tensors: dict[str, torch.Tensor] = {}
    for shard in (tmp_path / "out").glob("*.safetensors"):
        tensors.update(load_file(shard))
    float_weights: dict[str, torch.Tensor] = {}
    for shard in tiny_llama.glob("*.safetensors"):
        float_weights.update(load_file(shard))
    name = "model.layers.1.mlp.up_proj"
    scale = ssz_scales(float_weights[f"{name}.weight"], 8)
    assert torch.equal(tensors[f"{name}.weight_scale"], scale.reshape(-1, 1))
    assert torch.equal(tensors[f"{name}.weight_offset"], torch.zeros(scale.shape[0], 1))
    codes = ssz_codes(float_weights[f"{name}.weight"].t(), scale, 8).t().to(torch.int8)
    assert torch.equal(tensors[f"{name}.weight"], codes)
    description = json.loads((tmp_path / "out" / "quant_model_description.json").read_text())
    assert description[f"{name}.weight"] == "W8A16"
    assert description["model.layers.1.mlp.down_proj.weight"] == "FLOAT"
    rows = {row.module: row for row in msquant.plan(tiny_llama, data)}
    assert rows[f"{name}"].method == "ssz" and rows[f"{name}"].bits == 8


def test_ssz_goes_with_every_activation_scheme() -> None:
    registry = msquant.plugin.default_registry()
    for act in (
        {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"},
        {"dtype": "int8", "scope": "per_tensor", "symmetric": False, "method": "minmax"},
    ):
        for dtype in ("int8", "int4") if act["scope"] == "per_token" else ("int8",):
            data = config({"dtype": dtype})
            data["spec"]["process"][0]["qconfig"]["act"] = act
            msquant.validate_config(data, registry)
