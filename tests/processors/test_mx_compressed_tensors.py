"""MX linears in the compressed-tensors export: W8A8_MXFP8 as ``mxfp8-quantized`` and W4A4_MXFP4
as ``mxfp4-pack-quantized`` (the layouts vLLM 0.33 / 0.34's ``CompressedTensorsW8A8Mxfp8`` /
``CompressedTensorsW4A4Mxfp4`` and vLLM-Ascend 0.30's W8A8_MXFP8 / W4A4_MXFP4 schemes create).

Checked here: the config groups (validated by compressed-tensors' own ``QuantizationArgs`` and
``QuantizationConfig``), every tensor's dtype, shape and bytes against a float64 re-derivation of
msModelSlim's MX rules (the nibble order against compressed-tensors' own unpacking), compressed-
tensors' own MX decompressors (bit for bit equal to msquant's dequantized weights), ``msquant
verify``, ``msquant eval`` (logits equal to the Ascend export's simulation of the same scheme),
the plan's warning and refusal. That vLLM / vLLM-Ascend pick the MX schemes and every tensor
fills a parameter is the consumer suite's job (tests/consumers/test_vllm_mx.py).
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
from msquant import verify_export
from msquant.evaluate.models import load_model_for_eval
from msquant.plugin import QuantizedWeight
from msquant.plugin.numerics import value_type_named
from msquant.plugin.planning import build_plan

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: scheme -> (value type, compressed-tensors format, weight leaf)
SCHEMES = {
    "W8A8_MXFP8": ("mxfp8", "mxfp8-quantized", "weight"),
    "W4A4_MXFP4": ("mxfp4", "mxfp4-pack-quantized", "weight_packed"),
}
#: OCP e2m1 magnitudes by code (bit 3 is the sign)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def mx(dtype: str) -> dict[str, Any]:
    return {"scope": "per_block", "dtype": dtype, "symmetric": True, "method": "minmax"}


def config(weight: str, act: str, *savers: str, **entry: Any) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {"type": "linear_quant", "qconfig": {"weight": mx(weight), "act": mx(act)}, **entry}
            ],
            "save": [{"type": saver, "part_file_size": 0} for saver in savers],
        },
    }


def reference(weight: torch.Tensor, value_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 re-derivation of msModelSlim's MX rules (docs/value-types.md) for a float32 weight
    ``[out, in]``: ``(element values [out, in], shared exponents [out, in / 32])``."""
    blocks = weight.double().reshape(weight.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=-1)
    if value_type == "mxfp8":
        # floor(log2(amax)) exactly (frexp), minus emax 8; an all-zero block counts as 2^-126
        exponent = torch.frexp(amax.clamp(min=2.0**-126))[1].double() - 1 - 8
        exponent = exponent.clamp(min=-127)
        v = blocks / torch.exp2(exponent).unsqueeze(-1)
        p = torch.frexp(v.abs().clamp(min=2.0**-300))[1].double() - 1
        p = p.clamp(min=-6)
        steps = v / torch.exp2(p) * 8
        q = torch.sign(steps) * torch.floor(steps.abs() + 0.5) / 8 * torch.exp2(p)
        q = torch.where(v == 0, torch.zeros_like(q), q.clamp(-448, 448))
    else:
        exponent = (torch.floor(torch.log2(amax / 0.875 + 9.6e-7)) - 2).clamp(-129, 125)
        v = blocks.abs() / torch.exp2(exponent).unsqueeze(-1)
        p = torch.floor(torch.log2(v + 9.6e-7)).clamp(0, 2)
        q = (torch.floor(v / torch.exp2(p) * 2 + 0.5) / 2 * torch.exp2(p)).clamp(max=6)
        q = torch.sign(blocks) * q
    return q.reshape(weight.shape).float(), exponent.float()


def float_linears(model_dir: Path) -> dict[str, nn.Linear]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in LINEARS
    }


def decode_stored(stored: torch.Tensor, value_type: str) -> torch.Tensor:
    """The element values of a stored weight, unpacked here bit by bit (low nibble first)."""
    if value_type == "mxfp8":
        return stored.float()
    low, high = (stored & 0x0F).long(), (stored >> 4).long()
    nibbles = torch.stack((low, high), dim=-1).reshape(stored.shape[0], -1)
    magnitude = torch.tensor(E2M1)[nibbles & 0x7]
    return torch.where(nibbles >= 8, -magnitude, magnitude)


@pytest.fixture(scope="module")
def exports(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """scheme -> (model, export folder holding compressed_tensors/ and ascendv1_saver/), one run
    per scheme writing both formats from the same quantized model."""
    model_dir = tiny_model_factory("qwen2")  # q/k/v carry biases
    found = {}
    for scheme, (values, _, _) in SCHEMES.items():
        save = tmp_path_factory.mktemp(scheme) / "out"
        cfg = config(values, values, "compressed_tensors", "ascendv1_saver")
        msquant.quantize(model_dir, save, cfg, progress=False)
        found[scheme] = (model_dir, save)
    return found


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_mx_config_groups_are_compressed_tensors_presets(
    scheme: str, exports: dict[str, tuple[Path, Path]]
) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    _, save = exports[scheme]
    values, fmt, _ = SCHEMES[scheme]
    cfg = json.loads((save / "compressed_tensors" / "config.json").read_text(encoding="utf-8"))
    qconfig = cfg["quantization_config"]
    # mixed-precision: vLLM-Ascend 0.30 keeps MX input activations only under it
    assert qconfig["format"] == "mixed-precision" and qconfig["ignore"] == ["lm_head"]
    (group,) = qconfig["config_groups"].values()
    assert group["format"] == fmt and group["targets"] == ["Linear"]
    bits = value_type_named(values).bits
    weights = {
        "num_bits": bits,
        "type": "float",
        "symmetric": True,
        "group_size": 32,
        "strategy": "group",
        "dynamic": False,
        "scale_dtype": "torch.uint8",
    }
    assert group["weights"] == weights
    assert group["input_activations"] == {**weights, "dynamic": True}
    # compressed-tensors' own preset of the same name, as it serializes it
    preset = PRESET_SCHEMES[values.upper()]
    for key in ("weights", "input_activations"):
        assert preset[key].model_dump(mode="json") == group[key]
        parsed_args = QuantizationArgs.model_validate(group[key])  # extra="forbid"
        assert parsed_args.scale_dtype == torch.uint8
    parsed = QuantizationConfig.model_validate(qconfig)
    assert parsed.format == "mixed-precision"
    assert parsed.config_groups["group_0"].weights.scale_dtype == torch.uint8


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_mx_tensors_match_the_float64_reference(
    scheme: str, exports: dict[str, tuple[Path, Path]]
) -> None:
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    model_dir, save = exports[scheme]
    values, _, leaf = SCHEMES[scheme]
    tensors = load_file(str(save / "compressed_tensors" / "model.safetensors"))
    linears = float_linears(model_dir)
    assert len(linears) == 14
    for name, module in linears.items():
        out_features, in_features = module.weight.shape
        stored, scale = tensors[f"{name}.{leaf}"], tensors[f"{name}.weight_scale"]
        assert not {
            f"{name}.weight_shape",
            f"{name}.weight_zero_point",
            f"{name}.input_scale",
        } & set(tensors)
        if values == "mxfp8":
            assert (stored.dtype, stored.shape) == (
                torch.float8_e4m3fn,
                (out_features, in_features),
            )
            assert f"{name}.weight_packed" not in tensors
        else:
            assert (stored.dtype, stored.shape) == (torch.uint8, (out_features, in_features // 2))
            assert f"{name}.weight" not in tensors
            # compressed-tensors' own unpacking reads element 2i from the low nibble
            theirs = unpack_fp4_from_uint8(stored, out_features, in_features, torch.float32)
            assert torch.equal(theirs, decode_stored(stored, values)), name
        assert (scale.dtype, scale.shape) == (torch.uint8, (out_features, in_features // 32))
        elements, exponents = reference(module.weight.data, values)
        assert torch.equal(decode_stored(stored, values), elements), name
        assert torch.equal(scale.float() - 127, exponents), name
        assert (
            torch.equal(tensors[f"{name}.bias"], module.bias.data)
            if module.bias is not None
            else True
        )


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_decompresses_msquants_weights_bit_for_bit(
    scheme: str, exports: dict[str, tuple[Path, Path]]
) -> None:
    """compressed-tensors 0.20's own MX decompressors (``MXFP8QuantizationCompressor``,
    ``MXFP4PackedCompressor``) on the stored tensors give exactly msquant's dequantized weights."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    model_dir, save = exports[scheme]
    values, fmt, leaf = SCHEMES[scheme]
    cfg = json.loads((save / "compressed_tensors" / "config.json").read_text(encoding="utf-8"))
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    compressor = BaseCompressor.get_value_from_registry(fmt)
    qscheme = QuantizationScheme.model_validate(group)
    tensors = load_file(str(save / "compressed_tensors" / "model.safetensors"))
    for name, module in float_linears(model_dir).items():
        state = {part: tensors[f"{name}.{part}"] for part in (leaf, "weight_scale")}
        dense = compressor.decompress(state, qscheme)["weight"]
        want = QuantizedWeight.self_scaled(
            module.weight.data, value_type_named(values)
        ).dequantize()
        assert torch.equal(dense.float(), want), name


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_verify_reads_the_mx_export_and_eval_simulates_msquants_scheme(
    scheme: str, exports: dict[str, tuple[Path, Path]]
) -> None:
    model_dir, save = exports[scheme]
    values, _, _ = SCHEMES[scheme]
    ct = save / "compressed_tensors"
    report = verify_export(ct, model_path=model_dir)
    assert report.ok, report.errors
    assert report.format == "compressed-tensors"
    entry = report.layer("model.layers.0.mlp.down_proj")
    assert entry.value_type == values and entry.group_size == 32
    assert (
        entry.relative_error is not None
        and entry.relative_error < 0.5 * value_type_named(values).error_bound()
    )
    forward = report.forward
    assert forward is not None and abs(forward.relative_error - forward.rounded_error) < 1e-4
    assert any("weight-only" in warning for warning in report.warnings), report.warnings

    # msquant eval: the compressed-tensors export computes what the Ascend export of the same
    # run computes (MX weights, MX activations per block of 32), logits equal
    ct_model, kind = load_model_for_eval(ct)
    ascend_model, _ = load_model_for_eval(save / "ascendv1_saver")
    assert kind == "compressed-tensors"
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])
    with torch.no_grad():
        ct_logits = ct_model(ids).logits
        ascend_logits = ascend_model(ids).logits
        float_logits = AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits
    assert torch.equal(ct_logits, ascend_logits)
    assert not torch.allclose(ct_logits, float_logits, atol=1e-4)
    # and it quantizes the activations: one layer against its hand-built simulation
    name = "model.layers.1.mlp.up_proj"
    linear = float_linears(model_dir)[name]
    weight = QuantizedWeight.self_scaled(linear.weight.data, value_type_named(values)).dequantize()
    torch.manual_seed(3)
    x = torch.randn(2, linear.in_features)
    with torch.no_grad():
        got = ct_model.get_submodule(name)(x)
    fake = value_type_named(values).fake_quantize(x)
    assert torch.allclose(got, nn.functional.linear(fake, weight), atol=1e-5)


def test_verify_refuses_corrupted_mx_layers(
    exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    model_dir, save = exports["W4A4_MXFP4"]
    name = "model.layers.0.self_attn.o_proj"
    for change, needle in (
        ("scale", f"{name}.weight_packed: relative error 1.0"),
        ("packed_dtype", f"{name}.weight_packed: expected uint8 [out, in / 2]"),
        ("extra", f"{name}.weight_shape: not part of an MX layer"),
        ("scale_dtype", "weights.scale_dtype 'torch.float32', expected 'torch.uint8'"),
        ("weight_only", "input_activations must be an object"),
        ("group_size", "weights.group_size 16, expected 32"),
    ):
        copy = tmp_path / change
        shutil.copytree(save / "compressed_tensors", copy)
        # the export's record (its hashes would flag any change first) sits above the folder
        tensors = load_file(str(copy / "model.safetensors"))
        cfg_path = copy / "config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        group = cfg["quantization_config"]["config_groups"]["group_0"]
        if change == "scale":
            tensors[f"{name}.weight_scale"] += 1  # every block doubled
        elif change == "packed_dtype":
            tensors[f"{name}.weight_packed"] = tensors[f"{name}.weight_packed"].to(torch.int32)
        elif change == "extra":
            tensors[f"{name}.weight_shape"] = torch.tensor([64, 64])
        elif change == "scale_dtype":
            group["weights"]["scale_dtype"] = "torch.float32"
        elif change == "weight_only":
            group["input_activations"] = None
        else:
            group["weights"]["group_size"] = 16
        save_file(tensors, str(copy / "model.safetensors"))
        cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
        report = verify_export(copy, model_path=model_dir, forward=False)
        assert not report.ok
        assert any(needle in error for error in report.errors), (change, report.errors)


def test_plan_warns_vllm_runs_mx_weight_only_below_sm100(tiny_llama: Path) -> None:
    plan = build_plan(tiny_llama, config("mxfp8", "mxfp8", "compressed_tensors"))
    assert not plan.errors, plan.errors
    [warning] = [w for w in plan.warnings if "MX layers" in w]
    assert "SM100" in warning and "weight-only Marlin kernel" in warning
    assert "model.layers.0.self_attn.q_proj" in warning
    [ascend] = [w for w in plan.warnings if "vLLM-Ascend reads MX" in w]
    assert "0.26.0rc1 refuses them" in ascend and "compressed_tensors_config.py:346-364" in ascend


def test_w4a8_mxfp_is_refused_naming_the_engines(tiny_llama: Path, tmp_path: Path) -> None:
    """mxfp4 weights with mxfp8 activations: vLLM reads such a group as FP8 (float-scaled)
    activations, vLLM-Ascend 0.30 raises; refused before weights load."""
    cfg = config("mxfp4", "mxfp8", "compressed_tensors")
    plan = build_plan(tiny_llama, cfg)
    [error] = [e for e in plan.errors if "W4A8_MXFP (mxfp4 weights" in e]
    assert "compressed_tensors_config.py:346-382" in error and "ascendv1_saver" in error
    with pytest.raises(msquant.MsquantInputError, match="W4A8_MXFP"):
        msquant.quantize(tiny_llama, tmp_path / "out", cfg, progress=False)


def test_transformers_loads_the_mx_export_in_bfloat16(
    exports: dict[str, tuple[Path, Path]],
) -> None:
    """transformers + compressed-tensors 0.20 decompresses MX weights to bfloat16: served in
    bfloat16 the export loads and its weights are msquant's (exact: MX values fit bfloat16)."""
    for scheme, (model_dir, save) in exports.items():
        values = value_type_named(SCHEMES[scheme][0])
        loaded = AutoModelForCausalLM.from_pretrained(
            save / "compressed_tensors", dtype=torch.bfloat16
        ).eval()
        with torch.no_grad():
            loaded(torch.tensor([[1, 2, 3]]))  # decompresses on the first forward
        for name, module in float_linears(model_dir).items():
            dense = loaded.get_submodule(name).weight.detach()
            want = QuantizedWeight.self_scaled(module.weight.data, values).dequantize()
            assert dense.dtype == torch.bfloat16 and torch.equal(dense.float(), want), name


@pytest.mark.parametrize("value", ["mxfp8", "mxfp4"])
def test_plan_warns_vllm_runs_mx_moe_experts_weight_only_below_sm100(
    value: str, tiny_model_factory: Callable[..., Path]
) -> None:
    """MX experts of a Qwen3-MoE: vLLM 0.33 / 0.34's MX MoE methods load them (the consumer suite,
    test_vllm_mx.py) and, below SM100, run them on Marlin weight-only like the linears: the
    plan's warning names the experts and the MoE methods' kernel choice."""
    plan = build_plan(tiny_model_factory("qwen3_moe"), config(value, value, "compressed_tensors"))
    assert not plan.errors, plan.errors
    [warning] = [w for w in plan.warnings if "MX layers" in w]
    assert "MoE experts alike" in warning and "compressed_tensors_moe_w4a4_mxfp4.py:67" in warning
    assert "model.layers.0.mlp.experts.0.gate_proj" in warning
    # 2 layers x (4 attention linears + 8 experts x 3 projections); the routers stay float
    assert warning.endswith("model.layers.0.mlp.experts.0.up_proj and 50 more")


def test_an_mx_value_type_without_a_format_is_refused_not_mislabelled(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value type of the MX family that compressed-tensors has no format for (here mxfp4,
    as if only mxfp8 had one: the position of a value type added later) is refused at plan time
    and by the packer, instead of being written under another type's format."""
    from msquant.processors.formats.compressed_tensors import packer, saver

    only_mxfp8 = {"mxfp8": "mxfp8-quantized"}
    monkeypatch.setattr(saver, "MX_FORMATS", only_mxfp8)
    monkeypatch.setattr(packer, "MX_FORMATS", only_mxfp8)
    plan = build_plan(tiny_llama, config("mxfp4", "mxfp4", "compressed_tensors"))
    [error] = [e for e in plan.errors if "have no compressed-tensors format" in e]
    assert error.startswith("compressed_tensors: mxfp4 codes") and "ascendv1_saver" in error
    qweight = QuantizedWeight.self_scaled(torch.randn(4, 64), value_type_named("mxfp4"))
    with pytest.raises(msquant.QuantizationError, match="no format for mxfp4 codes"):
        packer.pack_mx_tensors("layer", qweight, None, None, torch.float32)
