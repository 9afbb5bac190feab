"""``qconfig.act`` in ``linear_quant``: W8A8 (static per-tensor activations) and W8A8_DYNAMIC
(per-token), exported in msModelSlim's Ascend layout and read back by ``msquant verify``.

The numbers are checked against float64 references written here, the calibration schedule against
an independent whole-model replay; that the layout and the online schedule are msModelSlim's own is
established by the opt-in oracle suite (``tests/oracle``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from activation_cases import CALIB_TOKENS, WEIGHT, WEIGHT_INT4, act, config, reference_codes
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

import msquant
import msquant.plugin
import msquant.plugin.planning
from msquant import ConfigError, QuantizationError, load_config_text, verify_export
from msquant.evaluate.models import load_model_for_eval
from msquant.load.calibration import read_calibration_texts
from msquant.planning.render import render_plan
from msquant.plugin import ActivationQuant, QuantizedLinear, QuantizedWeight, default_registry
from msquant.plugin.numerics import OnlineMinMax, decode_deq_scale
from msquant.run.checkpoint.store import LayerStore
from msquant.run.runner import batch_token_limit

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(model: Path, save: Path, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    msquant.quantize(
        model, save, cfg, calib_path=CALIB_TXT, progress=False, max_calib_tokens=CALIB_TOKENS
    )
    return load_file(str(save / "quant_model_weights.safetensors"))


def description(save: Path) -> dict[str, Any]:
    return json.loads((save / "quant_model_description.json").read_text(encoding="utf-8"))


def reference_act_params(lo: float, hi: float, symmetric: bool) -> tuple[float, float]:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        return max(-lo, hi) / 127, 0.0
    scale = (hi - lo) / 255
    return scale, float(round(-lo / scale) - 128)


def float_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in name
    }


def calibration_ids(model_dir: Path) -> list[torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        tokenizer(text, return_tensors="pt", truncation=True, max_length=CALIB_TOKENS)["input_ids"]
        for text in read_calibration_texts(CALIB_TXT)
    ]


# --- config ---------------------------------------------------------------------------------


def test_w8a8_and_w8a8_dynamic_configs_validate() -> None:
    registry = default_registry()
    for act_cfg in (act("per_tensor", False), act("per_tensor", True), act("per_token", True)):
        load_config_text(json.dumps(config(act_cfg)), registry)


@pytest.mark.parametrize(
    ("act_cfg", "weight", "entry", "path", "needle"),
    [
        (act("per_token", False), {}, {}, "qconfig.act", "per_token, symmetric: false"),
        ({**act(), "dtype": "int4"}, {}, {}, "qconfig.act", "dtype: int4"),
        ({**act(), "method": "histogram"}, {}, {}, "qconfig.act", "method: histogram"),
        ({**act(), "ext": {"x": 1}}, {}, {}, "qconfig.act.ext", "['x']"),
        (act(), {"method": "gptq"}, {}, "qconfig.weight", "method: gptq"),
        (act("per_token", True), {"method": "hessian_clip"}, {}, "qconfig.weight", "hessian_clip"),
        (act(), {"scope": "per_group"}, {}, "qconfig.weight", "scope: per_group"),
        (act(), {"symmetric": False}, {}, "qconfig.weight", "symmetric: false"),
        (act(), {"dtype": "int4"}, {}, "qconfig.weight", "dtype: int4"),
        (
            act("per_token", True),
            {"dtype": "int4", "scope": "per_group"},
            {},
            "qconfig.weight",
            "scope: per_group",
        ),
        (act(), {}, {"lm_head": True}, "lm_head", "lm_head: true"),
        (act(), {}, {"dynamic": {".*": {"bits": 4}}}, "dynamic", "include / exclude"),
    ],
)
def test_unimplemented_activation_combinations_are_refused(
    act_cfg: dict[str, Any], weight: dict[str, Any], entry: dict[str, Any], path: str, needle: str
) -> None:
    cfg = config(act_cfg, **entry)
    cfg["spec"]["process"][0]["qconfig"]["weight"] = {**WEIGHT, **weight}
    with pytest.raises(ConfigError) as info:
        load_config_text(json.dumps(cfg), default_registry())
    messages = {i.path: i.message for i in info.value.issues}
    message = messages[f"spec.process[0].{path}"]
    assert needle in message
    if path != "lm_head" and path != "dynamic" and path != "qconfig.act.ext":
        assert "implemented: W8A8 = act {dtype: int8, scope: per_tensor" in message


def test_static_activations_calibrate_one_sample_at_a_time() -> None:
    registry = default_registry()
    processors = {}
    for name, act_cfg in (("static", act()), ("dynamic", act("per_token", True))):
        spec = load_config_text(json.dumps(config(act_cfg)), registry).spec
        entry = spec.process[0]
        processors[name] = registry.get(entry.type)(entry)
    assert processors["static"].requires_calibration
    assert batch_token_limit([processors["static"]]) == 0
    # per-token activations need no calibration: the weights are round-to-nearest
    assert not processors["dynamic"].requires_calibration
    assert batch_token_limit([processors["dynamic"]]) > 0


def test_static_activations_refuse_a_dp_group() -> None:
    registry = default_registry()
    entry = load_config_text(json.dumps(config(act())), registry).spec.process[0]
    processor = registry.get(entry.type)(entry)
    group = SimpleNamespace(dist=msquant.plugin.Distributed(rank=0, world_size=2))
    with pytest.raises(QuantizationError, match="dp_layer_wise group of 2 processes"):
        processor.setup(group)  # type: ignore[arg-type]
    ctx = SimpleNamespace(dist=msquant.plugin.Distributed(), model=torch.nn.Linear(2, 2))
    processor.setup(ctx)  # type: ignore[arg-type]


# --- W8A8 static ----------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
def test_w8a8_export_layout_and_numerics(
    symmetric: bool, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen2")  # q/k/v carry biases
    tensors = run(model_dir, tmp_path / "out", config(act("per_tensor", symmetric)))
    types = description(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    linears = float_linears(model)
    expected = {}
    for name, module in linears.items():
        out_features, in_features = module.weight.shape
        expected.update(
            {
                f"{name}.weight": (torch.int8, (out_features, in_features), "W8A8"),
                f"{name}.input_scale": (torch.float32, (1,), "W8A8"),
                f"{name}.input_offset": (torch.float32, (1,), "W8A8"),
                f"{name}.deq_scale": (torch.int64, (out_features,), "W8A8"),
                f"{name}.quant_bias": (torch.int32, (out_features,), "W8A8"),
            }
        )
        if module.bias is not None:
            expected[f"{name}.bias"] = (torch.float32, (out_features,), "FLOAT")
    for key, value in model.state_dict().items():
        if key.rpartition(".")[0] not in linears:
            expected[key] = (value.dtype, tuple(value.shape), "FLOAT")
    got = {key: (t.dtype, tuple(t.shape), types[key]) for key, t in tensors.items()}
    assert got == expected
    assert types["model_quant_type"] == "W8A8" and types["group_size"] == 0

    for name, module in linears.items():
        codes, weight_scale = reference_codes(module.weight.data)
        assert torch.equal(tensors[f"{name}.weight"], codes), name
        input_scale = float(tensors[f"{name}.input_scale"])
        input_offset = float(tensors[f"{name}.input_offset"])
        assert input_offset == round(input_offset) and (input_offset == 0 or not symmetric)
        deq = decode_deq_scale(tensors[f"{name}.deq_scale"]).double()
        want = input_scale * weight_scale.reshape(-1)
        assert torch.allclose(deq, want, rtol=2 * torch.finfo(torch.float32).eps, atol=0), name
        row_sums = codes.to(torch.int64).sum(dim=1)
        assert torch.equal(
            tensors[f"{name}.quant_bias"], (-input_offset * row_sums).to(torch.int32)
        )
        if module.bias is not None:
            assert torch.equal(tensors[f"{name}.bias"], module.bias.data), name

    offsets = {float(tensors[f"{name}.input_offset"]) for name in linears}
    assert (offsets == {0.0}) == symmetric

    # layer 0's q/k/v see the float input norm's outputs: their range is the calibration set's
    norm_out: list[torch.Tensor] = []
    model.model.layers[0].input_layernorm.register_forward_hook(
        lambda _m, _i, out: norm_out.append(out.detach())
    )
    with torch.no_grad():
        for ids in calibration_ids(model_dir):
            model(input_ids=ids)
    lo = min(float(x.min()) for x in norm_out)
    hi = max(float(x.max()) for x in norm_out)
    scale, offset = reference_act_params(lo, hi, symmetric)
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}"
        assert float(tensors[f"{name}.input_scale"]) == pytest.approx(scale, rel=1e-6)
        assert float(tensors[f"{name}.input_offset"]) == offset


def test_w8a8_calibration_replays_the_online_schedule(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """The layer-wise run equals a whole-model replay that feeds the samples one at a time, every
    linear widening its running range and then computing with its input and weight fake-quantized
    (msModelSlim's schedule): every input_scale and input_offset bit for bit."""
    model_dir = tiny_model_factory("qwen2")
    tensors = run(model_dir, tmp_path / "out", config(act("per_tensor", False)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    observers: dict[str, OnlineMinMax] = {}
    for name, module in float_linears(model).items():
        # the fake-quantized weight in float32, as the kernels compute it
        scale32 = module.weight.data.abs().amax(dim=1, keepdim=True) / 127
        weight = torch.clamp(torch.round(module.weight.data / scale32), -128, 127) * scale32
        observer = observers[name] = OnlineMinMax(symmetric=False)

        def forward(
            x: torch.Tensor,
            o: OnlineMinMax = observer,
            w: torch.Tensor = weight,
            m: nn.Linear = module,
        ) -> torch.Tensor:
            return F.linear(o.observe(x), w, m.bias)

        module.forward = forward  # type: ignore[method-assign]
    with torch.no_grad():
        for ids in calibration_ids(model_dir):
            model(input_ids=ids)
    for name, observer in observers.items():
        scale, offset = observer.qparams()
        assert float(tensors[f"{name}.input_scale"]) == scale, name
        assert float(tensors[f"{name}.input_offset"]) == offset, name


def test_w8a8_bf16_model_stores_deq_scale_as_float32(tiny_llama_bf16: Path, tmp_path: Path) -> None:
    tensors = run(tiny_llama_bf16, tmp_path / "out", config(act("per_tensor", False)))
    name = "model.layers.0.mlp.down_proj"
    assert tensors[f"{name}.deq_scale"].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    report = verify_export(tmp_path / "out", model_path=tiny_llama_bf16)
    assert report.ok, report.errors


# --- W8A8_DYNAMIC ---------------------------------------------------------------------------


def test_w8a8_dynamic_export_layout_and_numerics(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen2")
    tensors = run(model_dir, tmp_path / "out", config(act("per_token", True)))
    types = description(tmp_path / "out")
    assert types["model_quant_type"] == "W8A8_DYNAMIC"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    for name, module in float_linears(model).items():
        codes, scale = reference_codes(module.weight.data)
        assert torch.equal(tensors[f"{name}.weight"], codes), name
        assert torch.allclose(tensors[f"{name}.weight_scale"].double(), scale, rtol=1e-7, atol=0)
        assert tensors[f"{name}.weight_offset"].shape == (module.out_features, 1)
        assert not tensors[f"{name}.weight_offset"].any()
        for part in ("weight", "weight_scale", "weight_offset"):
            assert types[f"{name}.{part}"] == "W8A8_DYNAMIC"
        assert not any(key.startswith(f"{name}.input_") for key in tensors)
        if module.bias is not None:
            assert types[f"{name}.bias"] == "FLOAT"
            assert torch.equal(tensors[f"{name}.bias"], module.bias.data)


# --- W4A8_DYNAMIC ---------------------------------------------------------------------------


def reference_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 per-channel symmetric codes and scales in float64."""
    w = weight.double()
    scale = w.abs().amax(dim=1, keepdim=True) / 7
    return torch.clamp(torch.round(w / scale), -8, 7).to(torch.int8), scale


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Independent int4 row unpacking: byte ``[i, j]`` holds row ``2i`` (low) and ``2i + 1`` (high)."""
    unsigned = packed.to(torch.int32) & 0xFF
    low, high = unsigned & 0xF, unsigned >> 4
    low, high = torch.where(low > 7, low - 16, low), torch.where(high > 7, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


def test_w4a8_dynamic_export_layout_and_numerics(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen2")
    tensors = run(model_dir, tmp_path / "out", config(act("per_token", True), weight=WEIGHT_INT4))
    types = description(tmp_path / "out")
    # W4A8_DYNAMIC is outside msModelSlim's priority list: its exports say FLOAT
    assert types["model_quant_type"] == "FLOAT" and types["group_size"] == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    for name, module in float_linears(model).items():
        out_features, in_features = module.weight.shape
        codes, scale = reference_int4(module.weight.data)
        packed = tensors[f"{name}.weight"]
        assert packed.dtype == torch.int8 and packed.shape == (out_features // 2, in_features)
        assert torch.equal(unpack_rows(packed), codes), name
        assert torch.allclose(tensors[f"{name}.weight_scale"].double(), scale, rtol=1e-7, atol=0)
        assert not tensors[f"{name}.weight_offset"].any()
        slices = 16 if name.endswith(("o_proj", "down_proj")) else 1
        bias = tensors[f"{name}.scale_bias"]
        assert bias.dtype == torch.float32 and bias.shape == (out_features, slices), name
        stored_scale = tensors[f"{name}.weight_scale"].double()
        want = 8 * (codes.double() * stored_scale).reshape(out_features, slices, -1).sum(dim=-1)
        assert torch.allclose(bias.double(), want, rtol=0, atol=1e-5), name
        for part in ("weight", "weight_scale", "weight_offset", "scale_bias"):
            assert types[f"{name}.{part}"] == "W4A8_DYNAMIC"
    report = verify_export(tmp_path / "out", model_path=model_dir)
    assert report.ok, report.errors
    assert not [w for w in report.warnings if "model_quant_type" in w]


def test_w4a8_dynamic_dense_layers_warn_for_vllm_ascend(tiny_llama: Path) -> None:
    plan = msquant.plugin.planning.build_plan(
        tiny_llama, config(act("per_token", True), weight=WEIGHT_INT4)
    )
    warnings = [w for w in plan.warnings if "vLLM-Ascend" in w]
    assert len(warnings) == 1 and "MoE experts only" in warnings[0]
    # true per release (tests/consumers/test_vllm_ascend_act.py): 0.30 has no such scheme,
    # 0.26's deprecated one divides by group_size 0
    assert "0.30.0rc2 removed" in warnings[0] and "0.26.0rc1" in warnings[0]
    assert "W4A16" not in warnings[0]
    assert plan.rows[0].act == "W4A8_DYNAMIC"
    table = render_plan(plan).splitlines()
    assert table[0].split()[:6] == ["module", "bits", "group", "sym", "method", "act"]
    assert table[1].split()[:6] == [
        "model.layers.0.self_attn.q_proj", "4", "channel", "yes", "minmax", "W4A8_DYNAMIC"
    ]  # fmt: skip


def test_w4a8_experts_beside_per_group_layers_warn_for_vllm_ascend_per_release(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """The description's one global group_size becomes the per-group layers' size, which
    vLLM-Ascend 0.30 refuses for W4A8_DYNAMIC experts and 0.26 misreads (tests/consumers,
    ``test_w4a8_experts_beside_per_group_layers``); per-channel everywhere: no warning."""
    model = tiny_model_factory("qwen3_moe", num_layers=2)
    experts = config(act("per_token", True), weight=WEIGHT_INT4, include=["*.experts.*"])
    per_group = {"dtype": "int8", "scope": "per_group", "symmetric": True, "method": "minmax"}
    for weight, expected in (({**per_group, "ext": {"group_size": 32}}, 1), (WEIGHT, 0)):
        cfg = json.loads(json.dumps(experts))
        attention = {"type": "linear_quant", "include": ["*self_attn*"]}
        if weight is WEIGHT:
            weight = {k: v for k, v in WEIGHT.items()}
        cfg["spec"]["process"].append({**attention, "qconfig": {"weight": weight}})
        plan = msquant.plugin.planning.build_plan(model, cfg)
        found = [w for w in plan.warnings if "global group_size" in w]
        assert len(found) == expected, plan.warnings
        if found:
            assert "0.30.0rc2 refuses them" in found[0] and "0.26.0rc1" in found[0]
            assert "(32)" in found[0] and "model.layers.0.mlp.experts.0." in found[0]


# --- MoE experts ---------------------------------------------------------------------------


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("weight", [WEIGHT, WEIGHT_INT4], ids=["W8A8_DYNAMIC", "W4A8_DYNAMIC"])
def test_dynamic_schemes_on_moe_experts(
    weight: dict[str, Any], tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Every expert is written under the checkpoint's per-expert names with the per-linear layout
    (vLLM-Ascend's W8A8_DYNAMIC / W4A8_DYNAMIC MoE schemes); the router stays float."""
    model_dir = tiny_model_factory("qwen3_moe", num_layers=2)
    save = tmp_path / "out"
    tensors = run(model_dir, save, config(act("per_token", True), weight=weight))
    types = description(save)
    kind = "W8A8_DYNAMIC" if weight is WEIGHT else "W4A8_DYNAMIC"
    expert = "model.layers.0.mlp.experts.3.down_proj"
    assert types[f"{expert}.weight"] == kind
    assert types["model.layers.0.mlp.gate.weight"] == "FLOAT"
    hidden = tensors["model.layers.0.mlp.gate.weight"].shape[1]
    rows = hidden // 2 if kind == "W4A8_DYNAMIC" else hidden
    assert tensors[f"{expert}.weight"].shape[0] == rows
    if kind == "W4A8_DYNAMIC":
        assert tensors[f"{expert}.scale_bias"].shape == (hidden, 16)
    report = verify_export(save, model_path=model_dir)
    assert report.ok, report.errors
    plan = msquant.plugin.planning.build_plan(
        model_dir, config(act("per_token", True), weight=weight)
    )
    assert not [w for w in plan.warnings if "MoE experts" in w and "cannot load" in w]


@NEEDS_MOE_TRANSFORMERS
def test_static_activations_on_moe_experts_are_refused(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3_moe", num_layers=2)
    with pytest.raises(msquant.MsquantInputError) as info:
        msquant.quantize(model_dir, tmp_path / "out", config(act()), progress=False)
    assert "static per_tensor activations (W8A8) on MoE experts are not implemented" in str(
        info.value
    )


# --- GPTQ weights under per-token activations -----------------------------------------------


def test_gptq_weights_under_per_token_activations(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """GPTQ's Hessian sees each linear's input unrounded, with the previous layers quantized
    weights and activations: layer 0 (float inputs) gets exactly the weights of the weight-only
    GPTQ run, layer 1 (inputs from the W8A8 layer 0) different ones; and GPTQ beats
    round-to-nearest on every module's output error."""
    model_dir = tiny_model_factory("qwen2")
    weight = {**WEIGHT, "method": "gptq"}
    results, tensors = {}, {}
    for kind, act_cfg in (("act", act("per_token", True)), ("float", {"dtype": "float"})):
        save = tmp_path / kind
        results[kind] = msquant.quantize(
            model_dir,
            save,
            config(act_cfg, weight=weight),
            calib_path=CALIB_TXT,
            progress=False,
            max_calib_tokens=CALIB_TOKENS,
        )
        tensors[kind] = load_file(str(save / "quant_model_weights.safetensors"))
    assert description(tmp_path / "act")["model_quant_type"] == "W8A8_DYNAMIC"
    for proj in ("self_attn.q_proj", "mlp.down_proj"):
        layer0, layer1 = f"model.layers.0.{proj}.weight", f"model.layers.1.{proj}.weight"
        assert torch.equal(tensors["act"][layer0], tensors["float"][layer0]), layer0
        assert not torch.equal(tensors["act"][layer1], tensors["float"][layer1]), layer1
    report = json.loads((tmp_path / "act" / "quant_report.json").read_text(encoding="utf-8"))
    modules = report["modules"]
    assert len(modules) == 14
    for module in modules:
        assert module["method"] == "gptq"
        assert module["output_error"] < module["rtn_output_error"], module["name"]


# --- msquant eval: the export rebuilt with its activation scheme -----------------------------


@pytest.mark.parametrize("scope", ["per_tensor", "per_token"])
def test_eval_model_of_an_export_quantizes_activations(
    scope: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen2")
    save = tmp_path / "out"
    tensors = run(model_dir, save, config(act(scope, scope == "per_token")))
    model, kind = load_model_for_eval(save)
    assert kind == "ascend"
    name = "model.layers.1.self_attn.q_proj"  # has a bias
    module = model.get_submodule(name)
    codes = tensors[f"{name}.weight"].double()
    if scope == "per_tensor":
        in_scale = float(tensors[f"{name}.input_scale"])
        in_offset = float(tensors[f"{name}.input_offset"])
        weight = (
            codes * (decode_deq_scale(tensors[f"{name}.deq_scale"]).double() / in_scale)[:, None]
        )
    else:
        weight = codes * tensors[f"{name}.weight_scale"].double()
    torch.manual_seed(1)
    x = torch.randn(2, 5, module.in_features)
    xd = x.double()
    if scope == "per_tensor":
        xq = (torch.clamp(torch.round(xd / in_scale + in_offset), -128, 127) - in_offset) * in_scale
    else:
        step = xd.abs().amax(dim=-1, keepdim=True) / 127
        xq = torch.clamp(torch.round(xd / step), -128, 127) * step
    bias = tensors[f"{name}.bias"].double()
    with torch.no_grad():
        got = module(x).double()
    assert torch.allclose(got, xq @ weight.T + bias, atol=1e-5)
    assert not torch.allclose(got, xd @ weight.T + bias, atol=1e-5)


# --- the quantized module and resume --------------------------------------------------------


def _qlinear(act_quant: ActivationQuant | None) -> tuple[QuantizedLinear, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(6, 8)
    codes, scale = reference_codes(weight)
    qweight = QuantizedWeight(codes, scale.float(), torch.zeros(6, 1), 8, True, None)
    return QuantizedLinear(qweight, torch.randn(6), "minmax", act=act_quant), (
        codes.double() * scale
    )


@pytest.mark.parametrize(
    "act_quant",
    [ActivationQuant("per_tensor", False, 0.02, -3.0), ActivationQuant("per_token")],
)
def test_quantized_linear_fake_quantizes_its_input(act_quant: ActivationQuant) -> None:
    module, weight = _qlinear(act_quant)
    x = torch.randn(3, 5, 8)
    xd = x.double()
    if act_quant.dynamic:
        step = xd.abs().amax(dim=-1, keepdim=True) / 127
        xq = torch.clamp(torch.round(xd / step), -128, 127) * step
    else:
        xq = (torch.clamp(torch.round(xd / 0.02 - 3.0), -128, 127) + 3.0) * 0.02
    want = xq @ weight.T + module.bias.double()
    assert torch.allclose(module(x).double(), want, atol=1e-5)
    assert not torch.allclose(module(x).double(), xd @ weight.T + module.bias.double(), atol=1e-5)
    # the state dict is the weight-only layout: the activation scheme is an attribute
    assert set(module.state_dict()) == {"weight", "weight_scale", "weight_offset", "bias"}


def test_checkpoint_store_keeps_the_activation_scheme(tmp_path: Path) -> None:
    module, _ = _qlinear(ActivationQuant("per_tensor", False, 0.015625, 7.0))
    root = nn.Sequential(nn.Linear(8, 6))
    root[0] = module
    store = LayerStore(tmp_path)
    store.save("00000", root, "")
    fresh = nn.Sequential(nn.Linear(8, 6))
    store.rebuild(fresh, "00000", weightless=False)
    assert isinstance(fresh[0], QuantizedLinear)
    assert fresh[0].act == module.act


# --- read back, and formats without activations ---------------------------------------------


def test_verify_checks_scale_bias(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    run(tiny_llama, save, config(act("per_token", True), weight=WEIGHT_INT4))
    (save / "msquant_export.json").unlink()
    tensors = load_file(str(save / "quant_model_weights.safetensors"))
    name = "model.layers.0.self_attn.o_proj"
    tensors[f"{name}.scale_bias"][3, 5] += 0.25
    save_file(tensors, str(save / "quant_model_weights.safetensors"))
    report = verify_export(save, model_path=tiny_llama)
    assert any(f"{name}.scale_bias: differs from 8 * the sum" in e for e in report.errors)


def test_verify_checks_quant_bias_and_deq_scale(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    run(tiny_llama, save, config(act("per_tensor", False)))
    assert verify_export(save, model_path=tiny_llama).ok
    name = "model.layers.1.mlp.down_proj"
    for change, needle in (
        ("quant_bias", f"{name}.quant_bias: 1 value(s) differ from -input_offset"),
        ("deq_dtype", f"{name}.deq_scale: float32, but the model is float32"),
    ):
        copy = tmp_path / change
        shutil.copytree(save, copy)
        (copy / "msquant_export.json").unlink()
        tensors = load_file(str(copy / "quant_model_weights.safetensors"))
        if change == "quant_bias":
            tensors[f"{name}.quant_bias"][0] += 1
        else:
            tensors[f"{name}.deq_scale"] = decode_deq_scale(tensors[f"{name}.deq_scale"])
        save_file(tensors, str(copy / "quant_model_weights.safetensors"))
        report = verify_export(copy, model_path=tiny_llama)
        assert not report.ok
        assert any(needle in error for error in report.errors), report.errors


def test_formats_without_activations_refuse_them_before_weights_load(
    tiny_llama: Path, tmp_path: Path
) -> None:
    cfg = config(act("per_token", True), saver="gptq_saver")
    with pytest.raises(msquant.MsquantInputError) as info:
        msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)
    assert "gptq_saver does not store activation scheme W8A8_DYNAMIC, which 14 layer(s)" in str(
        info.value
    )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_saver_without_activations_refuses_such_a_layer(tmp_path: Path) -> None:
    """The savers' own guard, behind the plan's check: never written as weight-only."""
    registry = default_registry()
    saver_cls = registry.get("gptq_saver")
    saver = saver_cls(saver_cls.config_class())
    saver.state = saver.state_class()  # type: ignore[attr-defined]
    module, _ = _qlinear(ActivationQuant("per_token"))
    root = nn.Sequential(nn.Linear(8, 6))
    root[0] = module
    with pytest.raises(QuantizationError, match=r"gptq_saver: x.0 has quantized act"):
        saver.write_quantized(None, root, "x")  # type: ignore[arg-type]


def test_killed_w8a8_run_resumes_to_the_uninterrupted_export(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The online-calibrated layer 0's outputs (the hidden states entering layer 1) and its
    activation parameters come back from the checkpoint: the resumed export is byte-identical."""
    from run.test_resume import _assert_same_export, _kill, _quantize

    cfg = config(act("per_tensor", False))
    _quantize(tiny_llama, tmp_path / "reference", cfg)
    _kill(tiny_llama, tmp_path / "out", cfg, after=0)
    _quantize(tiny_llama, tmp_path / "out", cfg, resume=True)
    _assert_same_export(tmp_path / "out", tmp_path / "reference")


def test_w8a8_static_of_a_float32_model_warns_about_bfloat16_serving(
    tiny_llama: Path, tiny_llama_bf16: Path
) -> None:
    """Its int64 deq_scale fits vLLM-Ascend's float16 serving only (tests/consumers)."""
    for model, expected in ((tiny_llama, 1), (tiny_llama_bf16, 0)):
        plan = msquant.plugin.planning.build_plan(model, config(act("per_tensor", True)))
        found = [w for w in plan.warnings if "deq_scale" in w]
        assert len(found) == expected, plan.warnings
        if found:
            assert "--dtype float16" in found[0] and "model.layers.0.self_attn.q_proj" in found[0]
    dynamic = msquant.plugin.planning.build_plan(tiny_llama, config(act("per_token", True)))
    assert not [w for w in dynamic.warnings if "deq_scale" in w]
