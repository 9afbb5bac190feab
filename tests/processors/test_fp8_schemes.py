"""W8A8 fp8 in ``linear_quant`` (issue 26): ``fp8_e4m3`` per-channel weights with ``fp8_e4m3``
per-token dynamic activations (msModelSlim's ``WFP8AFP8_DYNAMIC``), exported in the Ascend layout
and in compressed-tensors ``float-quantized``, read back and verified, simulated in
``msquant eval``; refusals of what is not implemented.

Numbers are checked against a float64 re-derivation of the rule (tests/quant/test_fp8_values.py
checks the value type itself); that the Ascend layout is msModelSlim's is the opt-in oracle's job
(tests/oracle/test_msmodelslim_fp8.py), that vLLM loads the compressed-tensors export the
consumer suite's (tests/consumers/test_vllm_fp8.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
from msquant import ConfigError, load_config_text, verify_export
from msquant.evaluate.models import load_model_for_eval
from msquant.plugin import ActivationQuant, QuantizedWeight, default_registry
from msquant.plugin.numerics import value_type_named
from msquant.plugin.planning import build_plan

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = value_type_named("fp8_e4m3")


def weight_config(**changes: Any) -> dict[str, Any]:
    return {
        "dtype": "fp8_e4m3",
        "scope": "per_channel",
        "symmetric": True,
        "method": "minmax",
        **changes,
    }


def act_config(**changes: Any) -> dict[str, Any]:
    return {**weight_config(scope="per_token"), **changes}


def config(
    weight: dict[str, Any] | None = None,
    act: dict[str, Any] | None = None,
    saver: str = "ascendv1_saver",
    **entry: Any,
) -> dict[str, Any]:
    qconfig = {"weight": weight or weight_config(), "act": act or act_config()}
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": qconfig, **entry}],
            "save": [{"type": saver, "part_file_size": 0}],
        },
    }


def reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 re-derivation of msModelSlim's FP8 rule for a float32 weight: the scale
    ``max(amax, 1e-12) / 448`` (float32), the element ``clamp(w / scale)`` cast to e4m3 with round
    half to even (the nearest of the e4m3 grid, ties to the even mantissa)."""
    w = weight.double()
    scale = (w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12).float() / 448).double()
    v = (w / scale).float().double().clamp(-448, 448)  # msModelSlim divides in float32
    grid = FP8.decode(torch.arange(256)).double()
    finite = grid[torch.isfinite(grid)]
    codes = torch.arange(256)[torch.isfinite(grid)]
    distance = (v.unsqueeze(-1) - finite).abs()
    best = distance.min(dim=-1, keepdim=True).values
    ties = distance == best
    # among equally near grid values, the one with the even code (even mantissa), sign of v
    even = ties & (codes % 2 == 0)
    pick = torch.where(even.any(dim=-1, keepdim=True), even, ties)
    value = (finite * pick).sum(-1) / pick.sum(-1)
    return value.float(), scale.float()


# --- config -----------------------------------------------------------------------------------


def test_w8a8_fp8_config_validates_and_plans(tiny_llama: Path) -> None:
    load_config_text(json.dumps(config()), default_registry())
    plan = build_plan(tiny_llama, config(include=["*mlp*"]))
    assert not plan.errors, plan.errors
    # the one warning: vLLM-Ascend's name for the type differs (below)
    assert [w.split(":")[0] for w in plan.warnings] == ["ascendv1_saver"], plan.warnings
    down = {row.module: row for row in plan.rows}["model.layers.0.mlp.down_proj"]
    assert (down.value_type, down.bits, down.group_size, down.act) == (
        "fp8_e4m3",
        8,
        -1,  # per-channel
        "WFP8AFP8_DYNAMIC",
    )


@pytest.mark.parametrize("saver", ["ascendv1_saver", "compressed_tensors"])
def test_the_plan_warns_that_vllm_ascend_refuses_the_ascend_fp8_type(
    saver: str, tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    """vLLM-Ascend 0.30 has no ``WFP8AFP8_DYNAMIC`` scheme (it calls the layer
    ``W8A8FP8_DYNAMIC``): the Ascend export says so and names the export that loads there."""
    path = tmp_path / "fp8.yaml"
    path.write_text(json.dumps(config(saver=saver, include=["*mlp*"])))
    result = run_cli("plan", "--model_path", tiny_llama, "--config_path", path)
    assert result.code == 0, result.err
    text = " ".join((result.out + result.err).split())
    refused = "has no scheme for this format's (msModelSlim's) WFP8AFP8_DYNAMIC type"
    if saver == "ascendv1_saver":
        assert refused in text and "spec.save: [{type: compressed_tensors}]" in text
        assert "model.layers.0.mlp.down_proj" in text
    else:
        assert refused not in text


@pytest.mark.parametrize(
    ("weight", "act", "path", "needle"),
    [
        (weight_config(), {"dtype": "float"}, "qconfig.act", "fp8_e4m3 weights with float"),
        (weight_config(scope="per_group"), None, "qconfig.weight", "per_channel symmetric"),
        (weight_config(symmetric=False), None, "qconfig.weight", "per_channel symmetric"),
        (None, act_config(scope="per_tensor"), "qconfig.act", "is not implemented"),
        (None, act_config(dtype="int8"), "qconfig.act", "is not implemented"),
        (
            {**weight_config(dtype="int8"), "scope": "per_channel"},
            None,
            "qconfig.weight",
            "is not implemented",
        ),
    ],
)
def test_unimplemented_fp8_combinations_are_refused(
    weight: dict[str, Any] | None, act: dict[str, Any] | None, path: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(json.dumps(config(weight, act)), default_registry())
    messages = {i.path: i.message for i in info.value.issues}
    assert needle in messages[f"spec.process[0].{path}"], messages


def test_formats_without_fp8_refuse_it_before_weights_load(
    tiny_llama: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        msquant.MsquantInputError, match="gptq_saver does not store activation scheme WFP8AFP8"
    ):
        msquant.quantize(tiny_llama, tmp_path / "out", config(saver="gptq_saver"), progress=False)


# --- Ascend export, read back, verify, eval -----------------------------------------------------


def float_linears(model_dir: Path) -> dict[str, nn.Linear]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in LINEARS
    }


def test_ascend_fp8_export_layout_numerics_verify_and_eval(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen2")  # q/k/v carry biases
    save = tmp_path / "out"
    msquant.quantize(model_dir, save, config(), progress=False)
    tensors = load_file(str(save / "quant_model_weights.safetensors"))
    types = json.loads((save / "quant_model_description.json").read_text(encoding="utf-8"))
    linears = float_linears(model_dir)
    assert len(linears) == 14
    for name, module in linears.items():
        out_features, in_features = module.weight.shape
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        assert {
            types[f"{name}.{leaf}"] for leaf in ("weight", "weight_scale", "weight_offset")
        } == {"WFP8AFP8_DYNAMIC"}
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (out_features, in_features)
        assert scale.dtype == torch.float32 and scale.shape == (out_features, 1)
        assert torch.equal(tensors[f"{name}.weight_offset"], torch.zeros(out_features, 1))
        want_elements, want_scale = reference(module.weight.data)
        assert torch.equal(scale, want_scale), name
        assert torch.equal(weight.float(), want_elements), name
        if module.bias is not None:
            assert types[f"{name}.bias"] == "FLOAT"
            assert torch.equal(tensors[f"{name}.bias"], module.bias.data.float())
    assert types["model_quant_type"] == "WFP8AFP8_DYNAMIC"

    report = verify_export(save, model_path=model_dir)
    assert report.ok, report.errors
    entry = report.layer("model.layers.0.mlp.down_proj")
    assert entry.value_type == "fp8_e4m3"
    assert entry.relative_error is not None and entry.relative_error < 0.05
    forward = report.forward
    assert forward is not None and abs(forward.relative_error - forward.rounded_error) < 1e-4

    eval_model, kind = load_model_for_eval(save)
    assert kind == "ascend"
    name = "model.layers.1.self_attn.q_proj"
    layer = eval_model.get_submodule(name)
    weight = QuantizedWeight.self_scaled(linears[name].weight.data, FP8).dequantize()
    torch.manual_seed(1)
    x = torch.randn(2, 5, layer.in_features)
    with torch.no_grad():
        got = layer(x)
    want = nn.functional.linear(FP8.fake_quantize(x), weight, linears[name].bias)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, nn.functional.linear(x, weight, linears[name].bias), atol=1e-4)


def test_verify_catches_corrupted_fp8_tensors(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    msquant.quantize(tiny_llama, save, config(), progress=False)
    name = "model.layers.0.self_attn.o_proj"
    for change, needle in (
        ("scale", f"{name}.weight: relative error"),
        ("nan", f"{name}.weight: 1 NaN float8_e4m3fn code(s)"),
        ("offset", f"{name}.weight_offset: WFP8AFP8_DYNAMIC is symmetric"),
        ("dtype", f"{name}.weight: dtype F32, expected float8_e4m3fn"),
    ):
        copy = tmp_path / change
        shutil.copytree(save, copy)
        (copy / "msquant_export.json").unlink()  # its hashes would flag any change first
        tensors = load_file(str(copy / "quant_model_weights.safetensors"))
        if change == "scale":
            tensors[f"{name}.weight_scale"] *= 3
        elif change == "nan":
            codes = tensors[f"{name}.weight"].view(torch.uint8).clone()
            codes[0, 0] = 0x7F
            tensors[f"{name}.weight"] = codes.view(torch.float8_e4m3fn)
        elif change == "offset":
            tensors[f"{name}.weight_offset"] += 1
        else:
            tensors[f"{name}.weight"] = tensors[f"{name}.weight"].float()
        save_file(tensors, str(copy / "quant_model_weights.safetensors"))
        report = verify_export(copy, model_path=tiny_llama, forward=False)
        assert not report.ok
        assert any(needle in error for error in report.errors), (change, report.errors)


def test_fp8_activation_scheme_names_and_round_trips() -> None:
    act = ActivationQuant("per_token", value_type="fp8_e4m3")
    assert act.dynamic and act.bits == 8
    assert act.scheme_name(8) == "WFP8AFP8_DYNAMIC"
    assert act.describe() == "a fp8_e4m3 per_token"
    assert ActivationQuant.from_json(act.to_json()) == act
    with pytest.raises(ValueError, match="per_tensor activations of fp8_e4m3"):
        ActivationQuant("per_tensor", scale=1.0, offset=0.0, value_type="fp8_e4m3")


# --- compressed-tensors export (float-quantized) ----------------------------------------------


def test_compressed_tensors_fp8_export_config_verify_eval_and_transformers(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The ``float-quantized`` layout and config (compressed-tensors' FP8_DYNAMIC preset), its
    arguments validated by compressed-tensors itself, read back by ``msquant verify``, simulated
    by ``msquant eval``; transformers + compressed-tensors loads it and its decompressed weights
    are msquant's."""
    from compressed_tensors.quantization import QuantizationArgs

    save = tmp_path / "ct"
    msquant.quantize(tiny_llama, save, config(saver="compressed_tensors"), progress=False)
    tensors = load_file(str(save / "model.safetensors"))
    qconfig = json.loads((save / "config.json").read_text(encoding="utf-8"))["quantization_config"]
    assert qconfig["format"] == "float-quantized"
    (group,) = qconfig["config_groups"].values()
    assert group["format"] == "float-quantized" and group["targets"] == ["Linear"]
    assert group["weights"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
    }
    assert group["input_activations"] == {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "token",
        "dynamic": True,
    }
    for key in ("weights", "input_activations"):
        QuantizationArgs.model_validate(group[key])  # extra="forbid": no unknown key
    assert qconfig["ignore"] == ["lm_head"]
    linears = float_linears(tiny_llama)
    for name, module in linears.items():
        want_elements, want_scale = reference(module.weight.data)
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(tensors[f"{name}.weight"].float(), want_elements), name
        assert tensors[f"{name}.weight_scale"].dtype == torch.float32
        assert torch.equal(tensors[f"{name}.weight_scale"], want_scale), name
        assert not {f"{name}.input_scale", f"{name}.weight_packed"} & set(tensors)

    report = verify_export(save, model_path=tiny_llama)
    assert report.ok, report.errors
    entry = report.layer("model.layers.0.mlp.down_proj")
    assert entry.value_type == "fp8_e4m3" and entry.relative_error is not None
    assert entry.relative_error < 0.05

    eval_model, _ = load_model_for_eval(save)
    name = "model.layers.1.mlp.up_proj"
    weight = QuantizedWeight.self_scaled(linears[name].weight.data, FP8).dequantize()
    torch.manual_seed(2)
    x = torch.randn(3, linears[name].in_features)
    with torch.no_grad():
        got = eval_model.get_submodule(name)(x)
    assert torch.allclose(got, nn.functional.linear(FP8.fake_quantize(x), weight), atol=1e-5)

    loaded = AutoModelForCausalLM.from_pretrained(save).eval()
    with torch.no_grad():
        loaded(torch.tensor([[1, 2, 3]]))  # decompresses on the first forward
    for name, module in linears.items():
        dense = loaded.get_submodule(name).weight.detach().float()
        want = QuantizedWeight.self_scaled(module.weight.data, FP8).dequantize()
        assert torch.allclose(dense, want, rtol=0, atol=0), name


def test_compressed_tensors_reader_refuses_fp8_groups_it_does_not_verify(
    tiny_llama: Path, tmp_path: Path
) -> None:
    save = tmp_path / "ct"
    msquant.quantize(tiny_llama, save, config(saver="compressed_tensors"), progress=False)
    for change, needle in (
        ("static", "input_activations.strategy 'tensor', expected 'token'"),
        ("weight_only", "weight-only FP8 (vLLM's CompressedTensorsW8A16Fp8)"),
        ("tensor", "weights.strategy 'tensor', expected 'channel'"),
    ):
        copy = tmp_path / change
        shutil.copytree(save, copy)
        (copy / "msquant_export.json").unlink()
        path = copy / "config.json"
        cfg = json.loads(path.read_text(encoding="utf-8"))
        group = cfg["quantization_config"]["config_groups"]["group_0"]
        if change == "static":
            group["input_activations"].update(strategy="tensor", dynamic=False)
        elif change == "weight_only":
            group["input_activations"] = None
        else:
            group["weights"]["strategy"] = "tensor"
        path.write_text(json.dumps(cfg), encoding="utf-8")
        report = verify_export(copy, model_path=tiny_llama, forward=False)
        assert not report.ok
        assert any(needle in error for error in report.errors), (change, report.errors)
