"""compressed-tensors int8 W8A8 (``int-quantized``): the export of ``linear_quant``'s
``qconfig.act`` for vLLM's ``CompressedTensorsW8A8Int8``, read back and loaded.

The numbers are msquant's W8A8 numerics, established against msModelSlim on the Ascend export
(tests/oracle): so the compressed-tensors tensors must equal the Ascend export's of the same run,
and the int8 codes a float64 reference. The config is compared with what llm-compressor 0.14
(compressed-tensors 0.19) writes for the same schemes. transformers (compressed-tensors 0.20.1)
loads the exports; its logits are compared with an independent float64-decoded reference whose
per-token activations use compressed-tensors' symmetric step ``max|x| / 127.5`` (vLLM's kernels
and msquant use ``max|x| / 127``; measured: 1.2e-2 relative logit difference between the two on
the tiny Qwen2, 0.0 for static activations).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from activation_cases import CALIB_TOKENS, WEIGHT_INT4, act, config, reference_codes
from compressed_tensors import QuantizationConfig
from conftest import CALIB_TXT
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
from msquant import QuantizationError, verify_export
from msquant.evaluate.models import load_model_for_eval
from msquant.plugin import ActivationQuant, QuantizedLinear, QuantizedWeight, default_registry
from msquant.plugin.numerics import decode_deq_scale
from msquant.processors.formats.compressed_tensors.config import WeightScheme
from msquant.processors.formats.compressed_tensors.consumers import (
    activation_warnings,
    transformers_loading_note,
)

IDS = torch.tensor([[1, 5, 17, 42, 99, 200, 301, 7, 64, 128, 3, 250]])
SCHEMES = {
    "static_sym": act("per_tensor", True),
    "static_asym": act("per_tensor", False),
    "dynamic": act("per_token", True),
}
#: ``input_activations`` of llm-compressor 0.14's exports of the same schemes (QuantizationModifier
#: with int8 channel weights on a tiny Llama), without the optional keys it adds
#: (``group_size: null``, ``observer``, ``block_structure``, ``actorder``, ``*_dtype``).
LLM_COMPRESSOR_INPUTS = {
    "static_sym": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                   "dynamic": False},
    "static_asym": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor",
                    "dynamic": False},
    "dynamic": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                "dynamic": True},
}  # fmt: skip
LLM_COMPRESSOR_WEIGHTS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "channel",
    "dynamic": False,
}


def quantize(model: Path, save: Path, cfg: dict[str, Any]) -> Path:
    msquant.quantize(
        model, save, cfg, calib_path=CALIB_TXT, progress=False, max_calib_tokens=CALIB_TOKENS
    )
    return save


@pytest.fixture(scope="module")
def exports(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny Qwen2 (q/k/v carry biases) exported in both formats for every scheme."""
    model = tiny_model_factory("qwen2")
    root = tmp_path_factory.mktemp("ct_w8a8")
    found = {"model": model}
    for name, act_cfg in SCHEMES.items():
        for saver in ("compressed_tensors", "ascendv1_saver"):
            found[f"{saver}_{name}"] = quantize(
                model, root / f"{saver}_{name}", config(act_cfg, saver)
            )
    return found


def float_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in name
    }


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_tensors_equal_the_ascend_export_and_the_float64_codes(
    scheme: str, exports: dict[str, Path]
) -> None:
    ct = load_file(str(exports[f"compressed_tensors_{scheme}"] / "model.safetensors"))
    ascend = load_file(str(exports[f"ascendv1_saver_{scheme}"] / "quant_model_weights.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(exports["model"], dtype="auto")
    linears = float_linears(model)
    expected = {}
    for name, module in linears.items():
        out_features, in_features = module.weight.shape
        expected[f"{name}.weight"] = (torch.int8, (out_features, in_features))
        expected[f"{name}.weight_scale"] = (torch.float32, (out_features, 1))
        if scheme != "dynamic":
            expected[f"{name}.input_scale"] = (torch.float32, (1,))
        if scheme == "static_asym":
            expected[f"{name}.input_zero_point"] = (torch.int8, (1,))
        if module.bias is not None:
            expected[f"{name}.bias"] = (torch.float32, (out_features,))
    for key, value in model.state_dict().items():
        if key.rpartition(".")[0] not in linears:
            expected[key] = (value.dtype, tuple(value.shape))
    assert {key: (t.dtype, tuple(t.shape)) for key, t in ct.items()} == expected

    for name, module in linears.items():
        codes, scale = reference_codes(module.weight.data)
        assert torch.equal(ct[f"{name}.weight"], codes), name
        assert torch.equal(ct[f"{name}.weight"], ascend[f"{name}.weight"]), name
        weight_scale = ct[f"{name}.weight_scale"]
        assert torch.allclose(weight_scale.double(), scale, rtol=2e-7, atol=0), name
        if scheme == "dynamic":
            assert torch.equal(weight_scale, ascend[f"{name}.weight_scale"]), name
        else:
            assert torch.equal(ct[f"{name}.input_scale"], ascend[f"{name}.input_scale"]), name
            # the Ascend export stores input_scale * weight_scale (float32) instead
            deq = decode_deq_scale(ascend[f"{name}.deq_scale"])
            assert torch.equal(deq, ct[f"{name}.input_scale"] * weight_scale.reshape(-1)), name
        if scheme == "static_asym":
            offset = ascend[f"{name}.input_offset"].to(torch.int8)
            assert torch.equal(ct[f"{name}.input_zero_point"], offset), name
    if scheme == "static_asym":
        assert any(int(ct[f"{name}.input_zero_point"]) != 0 for name in linears)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_config_is_llm_compressors_for_the_scheme(scheme: str, exports: dict[str, Path]) -> None:
    config_json = json.loads((exports[f"compressed_tensors_{scheme}"] / "config.json").read_text())
    qconfig = config_json["quantization_config"]
    assert qconfig["format"] == "int-quantized"
    assert qconfig["ignore"] == ["lm_head"]
    assert qconfig["config_groups"] == {
        "group_0": {
            "targets": ["Linear"],
            "weights": LLM_COMPRESSOR_WEIGHTS,
            "input_activations": LLM_COMPRESSOR_INPUTS[scheme],
            "output_activations": None,
            "format": "int-quantized",
        }
    }
    QuantizationConfig.model_validate(qconfig)


def test_weight_only_and_w8a8_groups_mix(tiny_llama: Path, tmp_path: Path) -> None:
    """Two linear_quant entries: W8A8_DYNAMIC attention, int4 weight-only MLP: two groups with
    their own formats, top-level ``mixed-precision``; verified and loaded by transformers."""
    cfg = config(act("per_token", True), saver="compressed_tensors", include=["*self_attn*"])
    cfg["spec"]["process"].append(
        {
            "type": "linear_quant",
            "qconfig": {"weight": {**WEIGHT_INT4, "scope": "per_group", "ext": {"group_size": 32}}},
            "include": ["*mlp*"],
        }
    )
    save = quantize(tiny_llama, tmp_path / "out", cfg)
    qconfig = json.loads((save / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == "mixed-precision"
    formats = {
        group["format"]: (group["input_activations"], group["targets"])
        for group in qconfig["config_groups"].values()
    }
    assert formats["int-quantized"][0] == LLM_COMPRESSOR_INPUTS["dynamic"]
    assert formats["pack-quantized"][0] is None
    QuantizationConfig.model_validate(qconfig)
    report = verify_export(save, model_path=tiny_llama)
    assert report.ok, report.errors
    tensors = load_file(str(save / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert "model.layers.0.mlp.up_proj.weight_packed" in tensors
    loaded = AutoModelForCausalLM.from_pretrained(save)
    simulated, _ = load_model_for_eval(save)
    with torch.no_grad():
        assert torch.isfinite(loaded(IDS).logits).all()
        assert torch.isfinite(simulated(IDS).logits).all()


# --- the independent reference ----------------------------------------------------------------


def reference_model(model_dir: Path, export: Path, token_step: float) -> nn.Module:
    """The float model with every linear's weight decoded in float64 from the export's tensors
    and its input fake-quantized from the stored activation parameters (per-token: symmetric,
    step ``max|x| / token_step``)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    tensors = load_file(str(export / "model.safetensors"))
    for name, module in float_linears(model).items():
        weight = tensors[f"{name}.weight"].double() * tensors[f"{name}.weight_scale"].double()
        module.weight.data = weight
        scale = tensors.get(f"{name}.input_scale")
        zero = tensors.get(f"{name}.input_zero_point")
        module.register_forward_pre_hook(_input_quantizer(scale, zero, token_step))
    return model


def _input_quantizer(
    scale: torch.Tensor | None, zero: torch.Tensor | None, token_step: float
) -> Callable[..., tuple[torch.Tensor, ...]]:
    def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        if scale is None:
            step = x.abs().amax(dim=-1, keepdim=True) / token_step
            return (torch.clamp(torch.round(x / step), -128, 127) * step,)
        s, z = float(scale[0]), 0.0 if zero is None else float(zero[0])
        return ((torch.clamp(torch.round(x / s) + z, -128, 127) - z) * s,)

    return hook


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_eval_simulation_and_transformers_match_the_reference(
    scheme: str, exports: dict[str, Path]
) -> None:
    """``msquant eval``'s model of the export is the float64 reference (per-token step
    ``max|x| / 127``, vLLM's) and simulates like the Ascend export of the same run. transformers
    (compressed-tensors 0.20.1) computes static activations the same; its dynamic per-token
    simulation differs (compressed-tensors' own step ``max|x| / 127.5`` among others; measured
    1.2e-2 relative logit difference on this model), so only its static runs are held exact."""
    export = exports[f"compressed_tensors_{scheme}"]
    with torch.no_grad():
        simulated = load_model_for_eval(export)[0](IDS).logits
        ascend = load_model_for_eval(exports[f"ascendv1_saver_{scheme}"])[0](IDS).logits
        loaded = AutoModelForCausalLM.from_pretrained(export)(IDS).logits
        reference = reference_model(exports["model"], export, 127.0)(IDS).logits
        float_logits = AutoModelForCausalLM.from_pretrained(exports["model"])(IDS).logits
    assert _relative(simulated, reference) < 1e-5
    assert _relative(simulated, ascend) < 1e-6  # static Ascend: weight scale from deq_scale
    assert _relative(simulated, float_logits) > 1e-3  # the activations are quantized
    if scheme == "dynamic":
        assert 1e-3 < _relative(loaded, simulated) < 3e-2
    else:
        assert _relative(loaded, reference) < 1e-5


# --- verify ---------------------------------------------------------------------------------


def _tamper(
    export: Path, tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], None]
) -> Path:
    copy = tmp_path / "tampered"
    shutil.copytree(export, copy)
    (copy / "msquant_export.json").unlink(missing_ok=True)
    tensors = load_file(str(copy / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


Q = "model.layers.1.self_attn.q_proj"
K = "model.layers.1.self_attn.k_proj"


def _set(
    name: str, value: Callable[[dict[str, torch.Tensor]], torch.Tensor]
) -> Callable[..., None]:
    """A change storing ``value(tensors)`` as tensor ``name``."""
    return lambda tensors: tensors.update({name: value(tensors)})


DAMAGE = {
    "zero_point_dropped": (
        "static_asym",
        lambda t: t.pop(f"{Q}.input_zero_point"),
        f"{Q}.input_zero_point: expected int8 [1]",
    ),
    "zero_point_int32": (
        "static_asym",
        _set(f"{Q}.input_zero_point", lambda t: t[f"{Q}.input_zero_point"].int()),
        "found torch.int32",
    ),
    "negative_input_scale": (
        "static_sym",
        _set(f"{Q}.input_scale", lambda t: -t[f"{Q}.input_scale"]),
        "is not a finite scale > 0",
    ),
    "zero_point_for_symmetric": (
        "static_sym",
        _set(f"{Q}.input_zero_point", lambda t: torch.zeros(1, dtype=torch.int8)),
        "stored for symmetric activations",
    ),
    "input_scale_for_dynamic": (
        "dynamic",
        _set(f"{Q}.input_scale", lambda t: torch.ones(1)),
        "stored for dynamic per-token activations",
    ),
    "fused_input_scales_differ": (
        "static_sym",
        _set(f"{K}.input_scale", lambda t: t[f"{K}.input_scale"] * 2),
        "model.layers.1.self_attn",
    ),
    "weight_scale_flat": (
        "dynamic",
        _set(f"{Q}.weight_scale", lambda t: t[f"{Q}.weight_scale"].reshape(-1)),
        f"{Q}.weight_scale: expected float",
    ),
    "codes_changed": (
        "dynamic",
        _set(f"{Q}.weight", lambda t: t[f"{Q}.weight"].clone().fill_(5)),
        Q,
    ),
}


@pytest.mark.parametrize(("scheme", "change", "needle"), list(DAMAGE.values()), ids=list(DAMAGE))
def test_verify_reads_w8a8_back_and_finds_damage(
    scheme: str,
    change: Callable[[dict[str, torch.Tensor]], None],
    needle: str,
    exports: dict[str, Path],
    tmp_path: Path,
) -> None:
    export = exports[f"compressed_tensors_{scheme}"]
    assert verify_export(export, model_path=exports["model"]).ok
    report = verify_export(_tamper(export, tmp_path, change), model_path=exports["model"])
    assert not report.ok
    assert any(needle in error for error in report.errors), report.errors


def test_verify_notes_vllms_zero_point_rebuild_for_static_asymmetric(
    exports: dict[str, Path],
) -> None:
    for scheme in SCHEMES:
        report = verify_export(exports[f"compressed_tensors_{scheme}"])
        assert report.ok
        noted = any("zero point" in warning for warning in report.warnings)
        assert noted == (scheme == "static_asym"), report.warnings


def test_verify_refuses_an_int_quantized_group_it_does_not_read(
    exports: dict[str, Path], tmp_path: Path
) -> None:
    copy = tmp_path / "asym_tokens"
    shutil.copytree(exports["compressed_tensors_dynamic"], copy)
    (copy / "msquant_export.json").unlink(missing_ok=True)
    config_json = json.loads((copy / "config.json").read_text())
    config_json["quantization_config"]["config_groups"]["group_0"]["input_activations"][
        "symmetric"
    ] = False
    (copy / "config.json").write_text(json.dumps(config_json))
    report = verify_export(copy)
    assert any("per-token activations must be symmetric" in e for e in report.errors), report.errors


# --- refusals -------------------------------------------------------------------------------


def test_w4a8_is_refused_before_weights_load_naming_the_ascend_export(
    tiny_llama: Path, tmp_path: Path
) -> None:
    cfg = config(act("per_token", True), saver="compressed_tensors", weight=WEIGHT_INT4)
    with pytest.raises(msquant.MsquantInputError) as info:
        msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)
    message = str(info.value)
    assert "compressed_tensors does not store activation scheme W4A8_DYNAMIC" in message
    assert "savers that store it: ascendv1_saver, mindie_format_saver" in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("saver", ["gptq_saver", "autoawq_saver"])
@pytest.mark.parametrize(("scheme", "able"), [
    ("per_token", "ascendv1_saver, compressed_tensors, mindie_format_saver"),
    ("per_tensor", "ascendv1_saver, compressed_tensors, mindie_format_saver"),
])  # fmt: skip
def test_weight_only_formats_refuse_activations_naming_the_formats_that_store_them(
    saver: str, scheme: str, able: str, tiny_llama: Path, tmp_path: Path
) -> None:
    cfg = config(act(scheme, True), saver=saver)
    with pytest.raises(msquant.MsquantInputError) as info:
        msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)
    name = "W8A8_DYNAMIC" if scheme == "per_token" else "W8A8"
    assert f"{saver} does not store activation scheme {name}, which 14 layer(s)" in str(info.value)
    assert f"savers that store it: {able}" in str(info.value)


def _qlinear(act_quant: ActivationQuant, bits: int = 8) -> QuantizedLinear:
    torch.manual_seed(0)
    codes, scale = reference_codes(torch.randn(6, 8))
    if bits == 4:
        codes = codes.clamp(-8, 7)
    qweight = QuantizedWeight(codes, scale.float(), torch.zeros(6, 1), bits, True, None)
    return QuantizedLinear(qweight, None, "minmax", act=act_quant)


def _saver() -> Any:
    saver_cls = default_registry().get("compressed_tensors")
    saver = saver_cls(saver_cls.config_class())
    saver.state = saver.state_class()
    return saver


def test_the_saver_refuses_a_w4a8_layer_itself(tmp_path: Path) -> None:
    """The saver's own guard behind the plan's check: never written as weight-only."""
    root = nn.Module()
    root.add_module("proj", _qlinear(ActivationQuant("per_token"), bits=4))
    with pytest.raises(QuantizationError, match=r"compressed_tensors: x.proj has quantized act"):
        _saver().write_quantized(None, root, "x")


def test_fused_shards_with_different_static_input_scales_are_refused() -> None:
    """vLLM loads one input scale per fused q/k/v: shards reading the same input share it."""
    attn = nn.Module()
    for proj, scale in (("q_proj", 0.02), ("k_proj", 0.02), ("v_proj", 0.03)):
        attn.add_module(proj, _qlinear(ActivationQuant("per_tensor", True, scale, 0.0)))
    layer = nn.Module()
    layer.add_module("self_attn", attn)
    saver = _saver()
    with pytest.raises(QuantizationError, match=r"one scheme per fused layer.*input_scale 0.03"):
        saver.check_fused(layer, "model.layers.0")
    attn.v_proj.act = ActivationQuant("per_tensor", True, 0.02, 0.0)
    saver.check_fused(layer, "model.layers.0")


def test_weight_scheme_of_w8a8_modules() -> None:
    dynamic = WeightScheme.of(_qlinear(ActivationQuant("per_token")))
    static = WeightScheme.of(_qlinear(ActivationQuant("per_tensor", False, 0.02, -3.0)))
    assert (dynamic.format, dynamic.input_strategy, str(dynamic)) == (
        "int-quantized", "token", "int8 per_channel sym a8 per_token"
    )  # fmt: skip
    assert static.input_args() == LLM_COMPRESSOR_INPUTS["static_asym"]
    assert static.weights_args() == LLM_COMPRESSOR_WEIGHTS
    assert WeightScheme(8, True, None).format == "pack-quantized"


def test_consumer_warnings_of_w8a8_schemes() -> None:
    """vLLM's CUTLASS kernel may shift a static asymmetric zero point (tests/consumers), and
    transformers simulates per-token activations with compressed-tensors' own step."""
    asym = WeightScheme(8, True, None, None, "tensor", False)
    sym = WeightScheme(8, True, None, None, "tensor", True)
    dynamic = WeightScheme(8, True, None, None, "token", True)
    warnings = activation_warnings({"a.q_proj": asym, "a.o_proj": sym, "a.up_proj": dynamic})
    assert len(warnings) == 1
    assert "zero point" in warnings[0] and warnings[0].endswith(": a.q_proj")
    assert activation_warnings({"a.o_proj": sym, "a.up_proj": dynamic}) == []
    assert "127.5" in transformers_loading_note([dynamic])
    assert "127.5" not in transformers_loading_note([sym])


def test_w8a8_moe_experts_warn_that_transformers_cannot_load_them() -> None:
    """transformers (the installed release; 5.24 and 5.25 measured, tests/consumers) fails with a
    RuntimeError on int8 W8A8 experts; weight-only experts and dense W8A8 layers load."""
    import transformers

    dynamic = WeightScheme(8, True, None, None, "token", True)
    weight_only = WeightScheme(4, True, 32)
    experts = {
        "m.layers.0.mlp.experts.0.gate_proj": dynamic,
        "m.layers.0.mlp.experts.1.up_proj": dynamic,
    }
    (warning,) = activation_warnings({"m.layers.0.self_attn.q_proj": dynamic, **experts})
    assert f"transformers {transformers.__version__}" in warning and "RuntimeError" in warning
    assert warning.endswith(": " + ", ".join(experts))
    assert activation_warnings({"m.layers.0.mlp.experts.0.gate_proj": weight_only}) == []


def test_cli_plan_exits_2_naming_the_savers_that_store_the_scheme(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    path = tmp_path / "gptq_w8a8.yaml"
    path.write_text(json.dumps(config(act("per_token", True), saver="gptq_saver")))
    result = run_cli("plan", "--model_path", tiny_llama, "--config_path", path)
    assert result.code == 2
    text = result.out + result.err
    assert "gptq_saver does not store activation scheme W8A8_DYNAMIC" in text
    assert "ascendv1_saver, compressed_tensors, mindie_format_saver" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("scope", ["per_tensor", "per_token"])
def test_killed_w8a8_run_resumes_to_the_uninterrupted_export(
    scope: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """The saver's checkpointed schemes (with their activation fields) come back: the resumed
    compressed-tensors export is byte-identical."""
    from run.test_resume import _assert_same_export, _kill, _quantize

    cfg = config(act(scope, False if scope == "per_tensor" else True), saver="compressed_tensors")
    _quantize(tiny_llama, tmp_path / "reference", cfg)
    _kill(tiny_llama, tmp_path / "out", cfg, after=0)
    _quantize(tiny_llama, tmp_path / "out", cfg, resume=True)
    _assert_same_export(tmp_path / "out", tmp_path / "reference")


def test_bfloat16_model_keeps_float32_scales_and_loads(
    tiny_llama_bf16: Path, tmp_path: Path
) -> None:
    save = quantize(
        tiny_llama_bf16, tmp_path / "out", config(act("per_tensor", False), "compressed_tensors")
    )
    tensors = load_file(str(save / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    assert tensors[f"{name}.weight_scale"].dtype == torch.float32
    assert tensors[f"{name}.input_scale"].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert verify_export(save, model_path=tiny_llama_bf16).ok
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(save)(IDS).logits
        simulated = load_model_for_eval(save)[0](IDS).logits
    assert _relative(loaded.float(), simulated.float()) < 2e-2  # bf16 compute on both sides
