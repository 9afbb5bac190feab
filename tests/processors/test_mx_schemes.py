"""MX schemes in ``linear_quant`` (issue 26): ``per_block`` ``mxfp8`` / ``mxfp4`` weights and
activations, exported in msModelSlim's Ascend layout (W8A8_MXFP8, W4A4_MXFP4, W4A8_MXFP), read
back and verified, simulated in ``msquant eval``; refusals of what is not implemented.

Numbers are checked against the value types' own quantization (:mod:`msquant.quant.mx_quant`,
itself checked against a float64 re-derivation in tests/quant/test_mx_numerics.py); that they
and the layout are msModelSlim's is the opt-in oracle's job (tests/oracle/test_msmodelslim_mx.py).
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
import msquant.plugin.planning
from msquant import ConfigError, QuantizationError, load_config_text, verify_export
from msquant.evaluate.models import load_model_for_eval
from msquant.planning.render import render_plan
from msquant.plugin import ActivationQuant, QuantizedLinear, QuantizedWeight, default_registry
from msquant.plugin.numerics import unpack_nibbles, value_type_named
from msquant.run.checkpoint.store import LayerStore

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: scheme -> (weight dtype, act dtype)
SCHEMES = {
    "W8A8_MXFP8": ("mxfp8", "mxfp8"),
    "W4A4_MXFP4": ("mxfp4", "mxfp4"),
    "W4A8_MXFP": ("mxfp4", "mxfp8"),
}


def mx(dtype: str, **ext: Any) -> dict[str, Any]:
    config = {"scope": "per_block", "dtype": dtype, "symmetric": True, "method": "minmax"}
    return {**config, "ext": ext} if ext else config


def config(
    weight: dict[str, Any], act: dict[str, Any] | None, saver: str = "ascendv1_saver", **entry: Any
) -> dict[str, Any]:
    qconfig = {"weight": weight, **({"act": act} if act is not None else {})}
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": qconfig, **entry}],
            "save": [{"type": saver, "part_file_size": 0}],
        },
    }


def scheme_config(scheme: str, **entry: Any) -> dict[str, Any]:
    weight, act = SCHEMES[scheme]
    return config(mx(weight), mx(act, axes=-1), **entry)


# --- config ---------------------------------------------------------------------------------


def test_mx_configs_validate() -> None:
    registry = default_registry()
    for scheme in SCHEMES:
        load_config_text(json.dumps(scheme_config(scheme)), registry)
    # longcat's form: the weight's ext.axes written too
    load_config_text(json.dumps(config(mx("mxfp4", axes=-1), mx("mxfp4", axes=-1))), registry)


@pytest.mark.parametrize(
    ("weight", "act", "entry", "path", "needle"),
    [
        (mx("mxfp8"), None, {}, "qconfig.act", "mxfp8 weights with float activations"),
        (
            {**mx("int8"), "scope": "per_block"},
            None,
            {},
            "qconfig.weight",
            "scope per_block is for the MX dtypes",
        ),
        (
            {**mx("mxfp8"), "scope": "per_channel"},
            mx("mxfp8"),
            {},
            "qconfig.weight",
            "scope per_channel",
        ),
        (
            mx("mxfp8"),
            {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"},
            {},
            "qconfig.act",
            "act {dtype: int8, scope: per_token",
        ),
        (mx("mxfp8"), mx("mxfp8", axes=0), {}, "qconfig.act.ext.axes", "got 0"),
        (mx("mxfp8"), mx("mxfp8", block=16), {}, "qconfig.act.ext", "['block']"),
        (
            {**mx("mxfp8"), "symmetric": False},
            mx("mxfp8"),
            {},
            "qconfig.weight",
            "symmetric: false",
        ),
        (mx("mxfp8"), mx("mxfp8"), {"lm_head": True}, "lm_head", "lm_head: true"),
    ],
)
def test_unimplemented_mx_combinations_are_refused(
    weight: dict[str, Any],
    act: dict[str, Any] | None,
    entry: dict[str, Any],
    path: str,
    needle: str,
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(json.dumps(config(weight, act, **entry)), default_registry())
    messages = {i.path: i.message for i in info.value.issues}
    assert needle in messages[f"spec.process[0].{path}"], messages


def test_weight_axes_other_than_minus_one_are_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(json.dumps(config(mx("mxfp8", axes=0), mx("mxfp8"))), default_registry())
    assert any("axes" in issue.path for issue in info.value.issues), info.value.issues


def test_gptq_has_no_mx_weights() -> None:
    weight = {**mx("mxfp8"), "method": "gptq"}
    with pytest.raises(ConfigError, match=r"\(dtype mxfp8, scope per_block\) is not implemented"):
        load_config_text(json.dumps(config(weight, mx("mxfp8"))), default_registry())


# --- export, read back, verify ----------------------------------------------------------------


def run(
    model: Path, save: Path, cfg: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    msquant.quantize(model, save, cfg, progress=False)
    tensors = load_file(str(save / "quant_model_weights.safetensors"))
    types = json.loads((save / "quant_model_description.json").read_text(encoding="utf-8"))
    return tensors, types


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_mx_export_layout_numerics_and_verify(
    scheme: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen2")  # q/k/v carry biases
    save = tmp_path / "out"
    tensors, types = run(model_dir, save, scheme_config(scheme))
    weight_type, act_type = SCHEMES[scheme]
    values = value_type_named(weight_type)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in LINEARS
    }
    assert len(linears) == 14
    for name, module in linears.items():
        out_features, in_features = module.weight.shape
        stored, stored_scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        assert types[f"{name}.weight"] == types[f"{name}.weight_scale"] == scheme
        assert f"{name}.weight_offset" not in tensors
        assert stored_scale.dtype == torch.uint8
        assert stored_scale.shape == (out_features, in_features // 32)
        if weight_type == "mxfp8":
            assert stored.dtype == torch.float8_e4m3fn and stored.shape == (
                out_features,
                in_features,
            )
            elements = stored.float()
        else:
            assert stored.dtype == torch.uint8 and stored.shape == (out_features, in_features // 2)
            elements = values.decode(unpack_nibbles(stored))
        codes, scale, _ = values.quantize(module.weight.data)
        assert torch.equal(elements, values.decode(codes)), name
        assert torch.equal(torch.pow(2.0, stored_scale.double() - 127).float(), scale), name
        if module.bias is not None:
            assert types[f"{name}.bias"] == "FLOAT"
            assert torch.equal(tensors[f"{name}.bias"], module.bias.data.float())
    assert types["model_quant_type"] == scheme and types["group_size"] == 32

    report = verify_export(save, model_path=model_dir)
    assert report.ok, report.errors
    entry = report.layer("model.layers.0.mlp.down_proj")
    assert entry.relative_error is not None
    assert entry.relative_error < values.error_bound() / 2
    assert entry.value_type == weight_type
    # the forward check's reference is the original rounded by the same value type: an honest
    # export computes exactly that
    forward = report.forward
    assert forward is not None and forward.scheme == f"{weight_type} weights"
    assert abs(forward.relative_error - forward.rounded_error) < 1e-4

    # msquant eval's model: dequantized weights, activations MX-quantized per block of 32
    eval_model, kind = load_model_for_eval(save)
    assert kind == "ascend"
    name = "model.layers.1.self_attn.q_proj"
    layer = eval_model.get_submodule(name)
    weight = QuantizedWeight.self_scaled(linears[name].weight.data, values).dequantize()
    torch.manual_seed(1)
    x = torch.randn(2, 5, layer.in_features)
    fake = value_type_named(act_type).fake_quantize(x)
    with torch.no_grad():
        got = layer(x)
    want = torch.nn.functional.linear(fake, weight, linears[name].bias)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(
        got, torch.nn.functional.linear(x, weight, linears[name].bias), atol=1e-4
    )


def test_verify_catches_corrupted_mx_tensors(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    run(tiny_llama, save, scheme_config("W8A8_MXFP8"))
    name = "model.layers.0.self_attn.o_proj"
    for change, needle in (
        ("scale", f"{name}.weight: relative error 0.99"),
        ("nan", f"{name}.weight: 1 NaN e4m3 code(s)"),
        ("dtype", f"{name}.weight: dtype F32, expected float8_e4m3fn"),
    ):
        copy = tmp_path / change
        shutil.copytree(save, copy)
        (copy / "msquant_export.json").unlink()  # its hashes would flag any change first
        tensors = load_file(str(copy / "quant_model_weights.safetensors"))
        if change == "scale":
            tensors[f"{name}.weight_scale"] += 1  # every block doubled
        elif change == "nan":
            codes = tensors[f"{name}.weight"].view(torch.uint8).clone()
            codes[0, 0] = 0x7F
            tensors[f"{name}.weight"] = codes.view(torch.float8_e4m3fn)
        else:
            tensors[f"{name}.weight"] = tensors[f"{name}.weight"].float()
        save_file(tensors, str(copy / "quant_model_weights.safetensors"))
        report = verify_export(copy, model_path=tiny_llama, forward=False)
        assert not report.ok
        assert any(needle in error for error in report.errors), report.errors


def test_plan_names_the_value_type(tiny_llama: Path) -> None:
    plan = msquant.plugin.planning.build_plan(
        tiny_llama, scheme_config("W4A4_MXFP4", include=["*mlp*"])
    )
    assert not plan.errors and not plan.warnings, (plan.errors, plan.warnings)
    rows = {row.module: row for row in plan.rows}
    down = rows["model.layers.0.mlp.down_proj"]
    assert (down.value_type, down.bits, down.group_size, down.act) == ("mxfp4", 4, 32, "W4A4_MXFP4")
    assert rows["model.layers.0.self_attn.q_proj"].value_type is None  # left in float
    table = [line.split() for line in render_plan(plan).splitlines()]
    row = next(cells for cells in table if cells[0] == "model.layers.0.mlp.down_proj")
    assert row[1:6] == ["mxfp4", "32", "yes", "minmax", "W4A4_MXFP4"]


def test_pairs_without_an_ascend_layer_are_refused_before_weights_load(
    tiny_llama: Path, tmp_path: Path
) -> None:
    cfg = config(mx("mxfp8"), mx("mxfp4"))  # msModelSlim has no W8A4 MX layer
    with pytest.raises(
        msquant.MsquantInputError, match="ascendv1_saver does not store activation scheme W8A4_MXFP"
    ):
        msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)


def test_formats_without_mx_refuse_it_before_weights_load(tiny_llama: Path, tmp_path: Path) -> None:
    cfg = scheme_config("W8A8_MXFP8", saver="gptq_saver")
    with pytest.raises(
        msquant.MsquantInputError, match="gptq_saver does not store activation scheme W8A8_MXFP8"
    ):
        msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)


def _mx_linear(act: ActivationQuant | None) -> QuantizedLinear:
    torch.manual_seed(0)
    qweight = QuantizedWeight.self_scaled(torch.randn(6, 64), value_type_named("mxfp8"))
    return QuantizedLinear(qweight, torch.randn(6), "minmax", act=act)


def test_a_saver_without_the_mx_family_refuses_such_a_layer() -> None:
    registry = default_registry()
    saver_cls = registry.get("gptq_saver")
    saver = saver_cls(saver_cls.config_class())
    saver.state = saver.state_class()  # type: ignore[attr-defined]
    root = nn.Sequential(nn.Linear(64, 6))
    root[0] = _mx_linear(None)
    with pytest.raises(QuantizationError, match=r"gptq_saver: x.0 holds mxfp8 codes"):
        saver.write_quantized(None, root, "x")  # type: ignore[arg-type]


def test_checkpoint_store_keeps_mx_layers(tmp_path: Path) -> None:
    module = _mx_linear(ActivationQuant("per_block", value_type="mxfp8"))
    root = nn.Sequential(nn.Linear(64, 6))
    root[0] = module
    store = LayerStore(tmp_path)
    store.save("00000", root, "")
    for weightless in (False, True):
        fresh = nn.Sequential(nn.Linear(64, 6))
        store.rebuild(fresh, "00000", weightless=weightless)
        rebuilt = fresh[0]
        assert isinstance(rebuilt, QuantizedLinear)
        assert rebuilt.value_type == module.value_type and rebuilt.act == module.act
        assert rebuilt.weight.dtype == torch.uint8
        if not weightless:
            assert torch.equal(rebuilt.dequantized_weight(), module.dequantized_weight())


def test_verify_names_an_int_layer_typed_mx(tiny_llama: Path, tmp_path: Path) -> None:
    weight = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
    save = tmp_path / "out"
    run(tiny_llama, save, config(weight, None))
    (save / "msquant_export.json").unlink()
    path = save / "quant_model_description.json"
    description = json.loads(path.read_text(encoding="utf-8"))
    name = "model.layers.0.mlp.down_proj"
    for part in ("weight", "weight_scale", "weight_offset"):
        description[f"{name}.{part}"] = "W8A8_MXFP8"
    path.write_text(json.dumps(description), encoding="utf-8")
    report = verify_export(save)
    assert not report.ok
    assert f"{name}.weight: dtype I8, expected float8_e4m3fn" in report.errors, report.errors
    assert any(f"{name}.weight_offset: unexpected tensor" in e for e in report.errors)
