"""``gptq_saver``: exports of the tiny models read back with the independent ``gptq_reader``.

Expected codes come from ``msquant.plugin.numerics.quantize_weight_minmax`` run on the original float weights (the
``minmax`` pipeline is deterministic), or, for ``method: gptq``, from the in-memory quantized layers
captured by a test processor; the reader knows only the on-disk layout (formats.md 3.1).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections.abc import Callable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import torch
from consumer_rules import optimum_quantized, vllm_linear_scheme
from gptq_reader import GPTQExport, read_gptq_export, read_module, resolve_scheme
from safetensors.torch import load_file

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant import QuantizationError
from msquant.plugin import (
    DecoderLayer,
    Processor,
    ProcessorConfig,
    QuantizedLinear,
    QuantizedWeight,
    RunContext,
)
from msquant.processors.formats.gptq.config import build_quantization_config, layer_units
from msquant.processors.formats.gptq.packer import gptq_module_tensors
from msquant.processors.formats.gptq.scheme import GPTQScheme

SAVER_LOGGER = "msquant.processors.formats.gptq.saver"
FP16_RTOL = 2.0**-11  # relative rounding of a float32 scale to float16

W8_CHANNEL_SYM = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
W4_G32_SYM = {
    "dtype": "int4",
    "scope": "per_group",
    "symmetric": True,
    "method": "minmax",
    "ext": {"group_size": 32},
}
W4_G32_ASYM = {**W4_G32_SYM, "symmetric": False}
W8_G32_ASYM = {**W4_G32_ASYM, "dtype": "int8"}


def make_config(
    weight: dict[str, Any],
    exclude: list[str] | None = None,
    include: list[str] | None = None,
    more_process: list[dict[str, Any]] | None = None,
    **save: Any,
) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "linear_quant", "qconfig": {"weight": weight}}
    if exclude:
        entry["exclude"] = exclude
    if include:
        entry["include"] = include
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [entry, *(more_process or [])],
            "save": [{"type": "gptq_saver", "part_file_size": 0, **save}],
        },
    }


def run(model: Path, save: Path, config: dict[str, Any], **kwargs: Any) -> GPTQExport:
    # verify=False: this file checks the export with its own reader.
    msquant.quantize(model, save, config, progress=False, verify=False, **kwargs)
    return read_gptq_export(save)


def scheme_of(weight: dict[str, Any]) -> dict[str, Any]:
    """The GPTQ scheme keys a linear_quant weight config should produce."""
    group = weight.get("ext", {}).get("group_size", -1) if weight["scope"] == "per_group" else -1
    return {
        "bits": 8 if weight["dtype"] == "int8" else 4,
        "group_size": group,
        "sym": weight["symmetric"],
        "desc_act": False,
    }


def linear_names(original: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len(".weight")] for k in original if k.endswith("_proj.weight"))


def fused_names(layers: int) -> list[str]:
    return [
        name
        for i in range(layers)
        for name in (f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.mlp.gate_up_proj")
    ]


def fused_members(fused: str) -> list[str]:
    parent, _, leaf = fused.rpartition(".")
    leaves = ("q_proj", "k_proj", "v_proj") if leaf == "qkv_proj" else ("gate_proj", "up_proj")
    return [f"{parent}.{m}" for m in leaves]


def assert_module_matches(
    module: Any, expected: QuantizedWeight, checkpoint_format: str, name: str
) -> None:
    """Codes and zero points bit for bit, scales as float16, dequantization within fp16 rounding."""
    bits = expected.bits
    assert torch.equal(module.codes, expected.unsigned_codes().long()), name
    zeros = expected.unsigned_zero_points().t().long()
    assert torch.equal(module.zeros, zeros), name
    stored = torch.remainder(zeros - 1, 2**bits) if checkpoint_format == "gptq" else zeros
    assert torch.equal(module.stored_zeros, stored), name
    assert torch.equal(module.scales, expected.scale.half().t()), name
    group = expected.effective_group_size
    assert torch.equal(module.g_idx, torch.arange(expected.shape[1], dtype=torch.int32) // group)
    dequantized, reference = module.dequantize(), expected.dequantize()
    assert torch.allclose(dequantized, reference, rtol=FP16_RTOL + 1e-6, atol=1e-12), name
    # The difference is the scale rounding: exact with the float16 scales.
    exact = expected.dequantize() / expected.scale.repeat_interleave(group, 1)
    assert torch.allclose(
        dequantized, exact * expected.scale.half().float().repeat_interleave(group, 1)
    )


# --- end to end, minmax against an independent expectation --------------------------------

CASES = {
    "w8_channel_sym_v1": (W8_CHANNEL_SYM, "gptq", []),
    "w4_g32_sym_v1": (W4_G32_SYM, "gptq", []),
    "w4_g32_asym_v1": (W4_G32_ASYM, "gptq", []),
    "w4_g32_asym_v2": (W4_G32_ASYM, "gptq_v2", []),
    "w4_g32_sym_v2_skip_down": (W4_G32_SYM, "gptq_v2", ["*down_proj"]),
    "w8_g32_asym_v1_skip_down": (W8_G32_ASYM, "gptq", ["*down_proj"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_minmax_export_matches_reference(case: str, tiny_llama: Path, tmp_path: Path) -> None:
    weight, checkpoint_format, exclude = CASES[case]
    config = make_config(weight, exclude, checkpoint_format=checkpoint_format)
    export = run(tiny_llama, tmp_path / "out", config)
    original = load_file(str(tiny_llama / "model.safetensors"))
    scheme = scheme_of(weight)
    bits, group = scheme["bits"], scheme["group_size"]
    linears = linear_names(original)
    quantized = [m for m in linears if not any(fnmatchcase(m, p) for p in exclude)]
    assert sorted(export.modules) == quantized

    # exactly the original tensors, quantized weights replaced by the four GPTQ tensors
    expected_names = {k for k in original if k[: -len(".weight")] not in quantized}
    for module in quantized:
        expected_names |= {f"{module}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")}
    assert set(export.tensors) == expected_names
    assert export.files == ["model.safetensors"]

    for name in quantized:
        w = original[f"{name}.weight"]
        expected = msquant.plugin.numerics.quantize_weight_minmax(
            w, bits, scheme["sym"], None if group == -1 else group
        )
        module = export.modules[name]
        assert (module.bits, module.group_size, module.sym) == (bits, group, scheme["sym"])
        out_f, in_f = w.shape
        assert tuple(export.tensors[f"{name}.qweight"].shape) == (in_f * bits // 32, out_f)
        assert_module_matches(module, expected, checkpoint_format, name)
        if scheme["sym"]:
            assert torch.all(module.zeros == 2 ** (bits - 1))
    for name, tensor in original.items():
        if name in export.tensors:
            assert export.tensors[name].dtype == tensor.dtype
            assert torch.equal(export.tensors[name], tensor), name

    qc = export.quantization_config
    assert export.quantize_config == qc
    base = {
        "bits": bits,
        "group_size": group,
        "desc_act": False,
        "sym": scheme["sym"],
        "lm_head": False,
        "method": "gptq",
        "quant_method": "gptq",
        "format": checkpoint_format,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
    }
    extra = ("dynamic", "meta", "modules_in_block_to_quantize")
    assert {k: v for k, v in qc.items() if k not in extra} == base
    assert qc["meta"]["quantizer"] == [f"msquant:{msquant.__version__}"]
    assert ("dynamic" in qc) == ("modules_in_block_to_quantize" in qc) == bool(exclude)
    for name in linears + fused_names(2):
        members = fused_members(name) if name.endswith(("qkv_proj", "gate_up_proj")) else [name]
        want = scheme if members[0] in quantized else None
        assert resolve_scheme(qc, name) == want, name
        assert vllm_linear_scheme(qc, name) == want, name  # with modules_in_block_to_quantize
    for name in linears:
        assert optimum_quantized(qc, name) == (name in quantized), name

    # the rest of config.json and the tokenizer are the model's
    source = json.loads((tiny_llama / "config.json").read_text())
    assert {k: v for k, v in export.config.items() if k != "quantization_config"} == source
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()


def test_sym_v1_and_v2_zero_point_words(tiny_llama: Path, tmp_path: Path) -> None:
    """Symmetric zero points: 8 (4-bit) / 128 (8-bit), stored as zero-1 in v1 (formats.md 2.4)."""
    expected_words = {
        ("int4", "gptq"): 0x77777777,
        ("int4", "gptq_v2"): 0x88888888 - 2**32,
        ("int8", "gptq"): 0x7F7F7F7F,
        ("int8", "gptq_v2"): 0x80808080 - 2**32,
    }
    for (dtype, checkpoint_format), word in expected_words.items():
        weight = {**W4_G32_SYM, "dtype": dtype}
        save = tmp_path / f"{dtype}_{checkpoint_format}"
        export = run(tiny_llama, save, make_config(weight, checkpoint_format=checkpoint_format))
        qzeros = export.tensors["model.layers.1.self_attn.k_proj.qzeros"]
        assert qzeros.dtype == torch.int32
        assert torch.all(qzeros == word), (dtype, checkpoint_format)


# --- dynamic rules --------------------------------------------------------------------------


def test_skipping_a_whole_fused_group_gets_one_rule_matching_members_and_fused_name(
    tiny_llama: Path, tmp_path: Path
) -> None:
    export = run(tiny_llama, tmp_path / "out", make_config(W4_G32_SYM, ["*gate_proj", "*up_proj"]))
    qc = export.quantization_config
    rules = list(qc["dynamic"])
    assert len(rules) == 1 and rules[0].startswith("-:")
    skipped = {f"model.layers.{i}.mlp.{m}" for i in range(2) for m in ("gate_proj", "up_proj")}
    skipped |= {f"model.layers.{i}.mlp.gate_up_proj" for i in range(2)}
    original = load_file(str(tiny_llama / "model.safetensors"))
    for name in linear_names(original) + fused_names(2):
        assert (resolve_scheme(qc, name) is None) == (name in skipped), name
        assert bool(re.match(rules[0][2:], name)) == (name in skipped), name
    assert "model.layers.0.mlp.gate_proj.weight" in export.tensors


def test_mixed_precision_rules(tiny_llama: Path, tmp_path: Path) -> None:
    """int4 attention (o_proj float), int8 per-channel MLP (layer 1 down_proj float)."""
    mlp = {
        "type": "linear_quant",
        "qconfig": {"weight": W8_CHANNEL_SYM},
        "include": ["*mlp*"],
        "exclude": ["model.layers.1.mlp.down_proj"],
    }
    config = make_config(
        W4_G32_SYM, ["*o_proj"], ["*self_attn*"], [mlp], checkpoint_format="gptq_v2"
    )
    export = run(tiny_llama, tmp_path / "out", config)
    original = load_file(str(tiny_llama / "model.safetensors"))
    qc = export.quantization_config
    assert export.quantize_config == qc
    # base = the most common scheme: 6 int4 attention layers against 5 int8 MLP layers
    assert (qc["bits"], qc["group_size"], qc["sym"]) == (4, 32, True)
    kinds = [pattern.startswith("-:") for pattern in qc["dynamic"]]
    assert kinds == sorted(kinds, reverse=True), "negative rules must come first"
    assert all(pattern.startswith(("-:", "+:")) for pattern in qc["dynamic"])
    for override in qc["dynamic"].values():
        assert override in ({}, {"bits": 8, "group_size": -1})

    int4 = scheme_of(W4_G32_SYM)
    int8 = scheme_of(W8_CHANNEL_SYM)

    def expected(name: str) -> dict[str, Any] | None:
        if name.endswith("o_proj") or name == "model.layers.1.mlp.down_proj":
            return None
        return int4 if ".self_attn." in name else int8

    for name in linear_names(original) + fused_names(2):
        assert resolve_scheme(qc, name) == expected(name), name
    for name, module in export.modules.items():
        want = expected(name)
        assert want is not None
        weight = original[f"{name}.weight"]
        group = None if want["group_size"] == -1 else want["group_size"]
        reference = msquant.plugin.numerics.quantize_weight_minmax(
            weight, want["bits"], True, group
        )
        assert_module_matches(module, reference, "gptq_v2", name)
    assert len(export.modules) == 11


def test_rules_match_exact_names_only() -> None:
    """Rules must not leak to layer 10 from layer 1, nor from a router ``mlp.gate`` to
    ``mlp.gate_proj`` / the fused ``mlp.gate_up_proj`` (patterns are anchored)."""
    int4, int8 = GPTQScheme(4, 128, True), GPTQScheme(8, -1, True)
    leaves = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate"]
    leaves += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]

    def scheme(layer: int, leaf: str) -> GPTQScheme | None:
        if leaf == "mlp.gate" and layer in (1, 10):
            return None if layer == 1 else int8
        return int8 if layer == 10 and leaf == "mlp.down_proj" else int4

    units = []
    for layer in range(12):
        linears = {
            f"model.layers.{layer}.{leaf}": (scheme(layer, leaf), torch.nn.Linear(128, 128))
            for leaf in leaves
        }
        units += layer_units(f"model.layers.{layer}", linears, msquant.plugin.ModelAdapter())
    qc = build_quantization_config(units, "gptq", ["minmax"])
    assert len(qc["dynamic"]) == 3  # -: layer 1 gate; +: layer 10 gate, layer 10 down
    for layer in range(12):
        names = [(leaf, leaf) for leaf in leaves]
        names += [("self_attn.qkv_proj", "self_attn.q_proj"), ("mlp.gate_up_proj", "mlp.up_proj")]
        for name, member in names:
            want = scheme(layer, member)
            got = resolve_scheme(qc, f"model.layers.{layer}.{name}")
            assert got == (None if want is None else {**want.as_config(), "desc_act": False}), (
                layer,
                name,
            )


def test_fused_group_with_differing_members_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    config = make_config(W4_G32_SYM, ["*q_proj"])
    with pytest.raises(QuantizationError, match=r"self_attn\.qkv_proj.*q_proj: not quantized"):
        msquant.quantize(tiny_llama, tmp_path / "out", config, progress=False, verify=False)
    assert not (tmp_path / "out").exists()


def test_no_quantized_layer_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    config = make_config(W4_G32_SYM, include=["lm_head"])
    with pytest.raises(QuantizationError, match="the config quantizes none of the model"):
        msquant.quantize(tiny_llama, tmp_path / "out", config, progress=False, verify=False)
    # the saver's own check, behind the plan's
    with pytest.raises(QuantizationError, match="no linear layer was quantized"):
        build_quantization_config([], "gptq", ["minmax"])


# --- consumer warnings and strict -----------------------------------------------------------


def saver_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SAVER_LOGGER and r.levelno == logging.WARNING
    ]


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_asymmetric_export_warns_and_names_the_alternative(
    checkpoint_format: str,
    tiny_llama: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    run(tiny_llama, tmp_path / "out", make_config(W4_G32_ASYM, checkpoint_format=checkpoint_format))
    messages = saver_warnings(caplog)
    vllm = [m for m in messages if "serve GPTQ checkpoints only" in m]
    assert len(vllm) == 1
    assert "int4 group 32 asym" in vllm[0] and "model.layers.0.self_attn.q_proj" in vllm[0]
    assert "type: compressed_tensors" in vllm[0]
    assert ("checkpoint_format: gptq_v2" in vllm[0]) == (checkpoint_format == "gptq")
    marlin = [m for m in messages if "Marlin" in m]
    assert (
        len(marlin) == 1
        and "model.layers.0.self_attn.qkv_proj [out 128, in 64, group_size 32]" in marlin[0]
    )
    assert len(messages) == 2


def test_strict_refuses_asymmetric(tiny_llama: Path, tmp_path: Path) -> None:
    config = make_config(W4_G32_ASYM, strict=True)
    with pytest.raises(QuantizationError, match=r"strict.*asym.*type: compressed_tensors"):
        msquant.quantize(tiny_llama, tmp_path / "out", config, progress=False, verify=False)
    assert not (tmp_path / "out").exists()


def test_marlin_sized_sym_int4_exports_without_warning_even_strict(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model_factory("llama", hidden_size=128, intermediate_size=256, num_layers=1)
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    export = run(model, tmp_path / "out", make_config(W4_G32_SYM, strict=True))
    assert saver_warnings(caplog) == []
    assert len(export.modules) == 7
    assert tuple(export.tensors["model.layers.0.mlp.down_proj.qweight"].shape) == (32, 128)


def test_skipped_layers_warn_about_marlin_only(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Float layers need no transformers warning: modules_in_block_to_quantize names the
    quantized ones for optimum, which ignores the `-:` rules."""
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    run(tiny_llama, tmp_path / "out", make_config(W8_CHANNEL_SYM, ["*down_proj"]))
    [marlin] = saver_warnings(caplog)
    assert "Marlin" in marlin
    assert "down_proj" not in marlin  # skipped layers are not loaded by Marlin


def test_layers_quantized_differently_warn_that_transformers_ignores_dynamic(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    config = make_config(W8_CHANNEL_SYM)
    config["spec"]["process"][0]["dynamic"] = {r".*\.1\..*mlp.*": {"bits": 4, "group_size": 32}}
    run(tiny_llama, tmp_path / "out", config)
    dynamic = next(m for m in saver_warnings(caplog) if "`dynamic`" in m)
    assert "transformers" in dynamic and "type: compressed_tensors" in dynamic


def test_unknown_keys_and_formats_are_rejected() -> None:
    config = make_config(W4_G32_SYM, checkpoint_format="gptq_v3", zero_minus_one=True)
    with pytest.raises(msquant.ConfigError) as error:
        msquant.validate_config(config, msquant.plugin.default_registry())
    text = str(error.value)
    assert "spec.save[0].checkpoint_format" in text and "spec.save[0].zero_minus_one" in text


# --- tied embeddings, biases and GPTQ-method weights ----------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_embeddings_tied_stored_once(
    tied: bool, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory("llama", tie_word_embeddings=tied, num_layers=1)
    export = run(model, tmp_path / "out", make_config(W8_CHANNEL_SYM))
    original = load_file(str(model / "model.safetensors"))
    assert ("lm_head.weight" in export.tensors) == (not tied)
    assert ("lm_head.weight" in original) == (not tied)
    assert torch.equal(
        export.tensors["model.embed_tokens.weight"], original["model.embed_tokens.weight"]
    )
    assert export.config["tie_word_embeddings"] is tied


class CaptureProcessor(Processor):
    """Test-only processor placed after linear_quant: records every layer's quantized weights."""

    type_name = "test_gptq_capture"
    stage = "process"
    captured: ClassVar[dict[str, QuantizedWeight]] = {}

    class Config(ProcessorConfig):
        type: Literal["test_gptq_capture"] = "test_gptq_capture"

    config_class = Config

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        for sub, module in layer.module.named_modules():
            if isinstance(module, QuantizedLinear):
                q = module.qweight
                CaptureProcessor.captured[f"{layer.name}.{sub}"] = QuantizedWeight(
                    q.codes.clone(),
                    q.scale.clone(),
                    q.offset.clone(),
                    q.bits,
                    q.symmetric,
                    q.group_size,
                )


def test_gptq_method_qwen2_with_bias_matches_in_memory_weights(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory("qwen2", num_layers=1)
    registry = msquant.plugin.default_registry()
    registry.register(CaptureProcessor)
    CaptureProcessor.captured.clear()
    weight = {**W4_G32_ASYM, "method": "gptq"}
    config = make_config(
        weight,
        ["*o_proj"],
        more_process=[{"type": "test_gptq_capture"}],
        checkpoint_format="gptq_v2",
    )
    export = run(model, tmp_path / "out", config, registry=registry, max_calib_tokens=32)
    original = load_file(str(model / "model.safetensors"))
    captured = CaptureProcessor.captured
    assert sorted(export.modules) == sorted(captured) and len(captured) == 6
    for name, module in export.modules.items():
        assert_module_matches(module, captured[name], "gptq_v2", name)
        if name.endswith(("q_proj", "k_proj", "v_proj")):
            bias = original[f"{name}.bias"]
            assert module.bias is not None and module.bias.dtype == torch.float16
            assert torch.equal(module.bias, bias.half())
        else:
            assert module.bias is None
    assert export.quantization_config["meta"]["msquant_methods"] == ["gptq"]
    assert export.tensors["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32


# --- the saver's tensor building, for what the pipeline cannot produce ----------------------


def make_linear(
    bits: int,
    out_features: int,
    in_features: int,
    group_size: int | None,
    symmetric: bool,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> QuantizedLinear:
    generator = torch.Generator().manual_seed(bits * 100 + out_features)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    codes = torch.randint(qmin, qmax + 1, (out_features, in_features), generator=generator)
    groups = 1 if group_size is None else in_features // group_size
    if scale is None:
        scale = torch.rand(out_features, groups, generator=generator) * 0.1 + 1e-3
    offset = torch.zeros(out_features, groups)
    if not symmetric:  # unsigned zero points 1..2^b-1: v1 cannot store 0 (tested separately)
        offset = torch.randint(
            qmin + 1, qmax + 1, (out_features, groups), generator=generator
        ).float()
    weight = QuantizedWeight(codes.to(torch.int8), scale, offset, bits, symmetric, group_size)
    return QuantizedLinear(weight, bias, "minmax")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_module_tensors_all_bit_widths(
    bits: int, checkpoint_format: Literal["gptq", "gptq_v2"], symmetric: bool
) -> None:
    bias = torch.linspace(-1, 1, 32)
    linear = make_linear(bits, 32, 64, 16, symmetric, bias=bias)
    before = {k: v.clone() for k, v in linear.state_dict().items()}
    tensors = gptq_module_tensors("blk.proj", linear, checkpoint_format)
    assert set(tensors) == {
        f"blk.proj.{s}" for s in ("qweight", "qzeros", "scales", "g_idx", "bias")
    }
    assert tuple(tensors["blk.proj.qweight"].shape) == (64 * bits // 32, 32)
    assert tuple(tensors["blk.proj.qzeros"].shape) == (4, 32 * bits // 32)
    scheme = {"bits": bits, "group_size": 16, "sym": symmetric}
    module = read_module("blk.proj", tensors, scheme, checkpoint_format)
    assert_module_matches(module, linear.qweight, checkpoint_format, "blk.proj")
    assert module.bias is not None and torch.equal(module.bias, bias.half())
    for key, value in linear.state_dict().items():  # the input is not modified
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("bits", [5, 6, 7])
def test_planar_bit_widths_are_refused(bits: int) -> None:
    with pytest.raises(
        QuantizationError, match=r"blk\.proj: int\d.*gptq_p.*type: compressed_tensors"
    ):
        gptq_module_tensors("blk.proj", make_linear(bits, 32, 64, None, True), "gptq")


@pytest.mark.parametrize("value", [1e5, 1e-9])
def test_scales_outside_float16_are_refused(value: float) -> None:
    scale = torch.full((32, 1), 0.01)
    scale[3, 0] = value
    linear = make_linear(4, 32, 64, None, True, scale=scale)
    with pytest.raises(
        QuantizationError, match=r"blk\.proj: 1 scale\(s\) are not representable in float16"
    ):
        gptq_module_tensors("blk.proj", linear, "gptq")


def test_shapes_not_filling_whole_words_are_refused() -> None:
    linear = make_linear(3, 32, 16, None, True)  # 16 * 3 bits = 48, not a multiple of 32
    with pytest.raises(QuantizationError, match=r"blk\.proj: in_features 16 times 3 bits"):
        gptq_module_tensors("blk.proj", linear, "gptq")


# --- a real client, when installed ----------------------------------------------------------

HAS_GPTQ_CLIENT = all(importlib.util.find_spec(m) for m in ("optimum", "gptqmodel"))


@pytest.mark.skipif(not HAS_GPTQ_CLIENT, reason="optimum and gptqmodel are not installed")
@pytest.mark.parametrize("case", ["w4_g32_sym_v1", "w4_g32_asym_v2"])
def test_transformers_loads_export(case: str, tiny_llama: Path, tmp_path: Path) -> None:
    """transformers + optimum + gptqmodel (CPU) reproduce the reader's dequantized model."""
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    weight, checkpoint_format, _ = CASES[case]
    save = tmp_path / "out"
    export = run(tiny_llama, save, make_config(weight, checkpoint_format=checkpoint_format))
    loaded = AutoModelForCausalLM.from_pretrained(save, device_map="cpu").eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float16).eval()
    with torch.no_grad():
        for name, module in export.modules.items():
            reference.get_submodule(name).weight.copy_(module.dequantize().half())
        ids = torch.arange(1, 17).unsqueeze(0)
        got, want = loaded(ids).logits.float(), reference(ids).logits.float()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize(
    ("weight", "expected"), [(W4_G32_SYM, "gptq"), (W4_G32_ASYM, "gptq_v2")], ids=["sym", "asym"]
)
def test_auto_format_is_v1_for_symmetric_and_v2_for_asymmetric(
    weight: dict[str, Any], expected: str, tiny_llama: Path, tmp_path: Path
) -> None:
    run(tiny_llama, tmp_path / "out", make_config(weight))  # checkpoint_format defaults to auto
    config = json.loads((tmp_path / "out" / "quantize_config.json").read_text())
    assert config["format"] == config["checkpoint_format"] == expected


def test_v1_refuses_asymmetric_zero_points_of_zero(tiny_llama: Path, tmp_path: Path) -> None:
    """Groups of 8 on the tiny model contain all-positive groups, whose zero point is 0."""
    weight = {**W4_G32_ASYM, "ext": {"group_size": 8}}
    with pytest.raises(msquant.QuantizationError) as info:
        run(tiny_llama, tmp_path / "v1", make_config(weight, checkpoint_format="gptq"))
    message = str(info.value)
    assert "zero point(s) are 0" in message and "checkpoint_format: gptq_v2" in message
    assert not (tmp_path / "v1").exists()
    export = run(tiny_llama, tmp_path / "v2", make_config(weight, checkpoint_format="gptq_v2"))
    assert export.quantization_config["checkpoint_format"] == "gptq_v2"
    msquant.check_export(tmp_path / "v2")
