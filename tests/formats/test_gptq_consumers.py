"""GPTQ exports as their consumers read them (issue 13, section 1, items 1-5).

Each export is read with the consumers' own rules, re-implemented from their sources in
``consumer_rules`` (vLLM's ``dynamic`` lookups by layer, fused and experts-module name and its
``modules_in_block_to_quantize`` substring test; optimum's suffix test; SGLang's MoE method), and
compared with what the files store; the saver's warnings and ``msquant verify``'s notes are
matched against what each consumer does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import NEEDS_MOE_TRANSFORMERS
from consumer_rules import (
    optimum_quantized,
    sglang_moe_scheme,
    vllm_linear_scheme,
    vllm_scheme,
)
from gptq_reader import read_gptq_export, resolve_scheme

import msquant
import msquant.plugin
import msquant.plugin.planning
from msquant.processors.formats.gptq.config import RuleUnit
from msquant.processors.formats.gptq.scheme import GPTQScheme

SAVER_LOGGER = "msquant.processors.formats.gptq.saver"
W4_G32 = {
    "dtype": "int4",
    "scope": "per_group",
    "symmetric": True,
    "method": "minmax",
    "ext": {"group_size": 32},
}
BASE = {"bits": 4, "group_size": 32, "sym": True, "desc_act": False}
INT8_G32 = {**BASE, "bits": 8}
#: The experts module of layer ``i`` on disk, and its projections on disk.
EXPERTS = {
    "qwen3_moe": ("model.layers.{i}.mlp.experts", ("gate_proj", "up_proj", "down_proj"), 8),
    "mixtral": ("model.layers.{i}.block_sparse_moe.experts", ("w1", "w3", "w2"), 4),
}
MOE_MODELS = {"qwen3_moe": {"num_layers": 2}, "mixtral": {"num_layers": 2, "intermediate_size": 32}}


def _config(
    weight: dict[str, Any] = W4_G32, save: dict[str, Any] | None = None, **entry: Any
) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}, **entry}],
            "save": [{"type": "gptq_saver", "part_file_size": 0, **(save or {})}],
        },
    }


def _export(model: Path, save: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Quantize (the run verifies the export itself) and return ``quantization_config``."""
    msquant.quantize(model, save, config, progress=False)
    return json.loads((save / "config.json").read_text())["quantization_config"]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SAVER_LOGGER and r.levelno == logging.WARNING
    ]


# --- item 1: MoE experts left in float or quantized otherwise ------------------------------------


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("arch", sorted(EXPERTS))
@pytest.mark.parametrize("layer1", ["float", "int8"])
def test_vllm_finds_the_rule_of_an_experts_module_by_its_name(
    arch: str,
    layer1: str,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Layer 1's experts in float (exclude) or int8 (a rule) on an int4 base: vLLM's FusedMoE
    lookup by the experts module's name and GPTQModel's per-expert lookup both find it, layer 0's
    experts keep the base; SGLang (dynamic ignored for MoE) is named as unable to serve it."""
    model = tiny_model_factory(arch, **MOE_MODELS[arch])
    pattern, projections, count = EXPERTS[arch]
    entry: dict[str, Any] = (
        {"exclude": ["model.layers.1.mlp.experts.*"]}
        if layer1 == "float"
        else {"dynamic": {r".*\.1\.mlp\.experts\..*": {"bits": 8}}}
    )
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    qc = _export(model, tmp_path / "out", _config(**entry))
    expected = None if layer1 == "float" else INT8_G32
    experts0, experts1 = pattern.format(i=0), pattern.format(i=1)
    assert vllm_scheme(qc, experts1) == expected  # vLLM's FusedMoE of layer 1
    assert vllm_scheme(qc, experts0) == BASE
    for index in range(count):
        for projection in projections:  # GPTQModel's per-expert lookups
            assert resolve_scheme(qc, f"{experts1}.{index}.{projection}") == expected
            assert resolve_scheme(qc, f"{experts0}.{index}.{projection}") == BASE
    for fused in ("self_attn.qkv_proj", "self_attn.o_proj"):
        assert vllm_scheme(qc, f"model.layers.1.{fused}") == BASE
    assert sglang_moe_scheme(qc) == BASE != expected  # so SGLang cannot serve layer 1
    [sglang] = [m for m in _warnings(caplog) if "SGLang" in m and "MoE" in m]
    assert experts1 in sglang and experts0 not in sglang
    assert "SGLang cannot serve this checkpoint" in sglang
    report = msquant.verify_export(tmp_path / "out", model_path=model)
    assert report.ok, report.errors
    assert any("SGLang's GPTQ MoE method ignores" in w and experts1 in w for w in report.warnings)
    loaders = [w for w in report.warnings if "loads correctly only in" in w]
    assert all("SGLang" not in w for w in loaders)
    assert (layer1 == "int8") == bool(loaders)


@NEEDS_MOE_TRANSFORMERS
def test_moe_experts_in_the_base_scheme_need_no_rule_and_suit_sglang(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model_factory("qwen3_moe", **MOE_MODELS["qwen3_moe"])
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    qc = _export(model, tmp_path / "out", _config())
    assert "dynamic" not in qc and "modules_in_block_to_quantize" not in qc
    assert not [m for m in _warnings(caplog) if "SGLang cannot serve" in m]
    report = msquant.verify_export(tmp_path / "out")
    assert report.ok and not any("SGLang's GPTQ MoE" in w for w in report.warnings)


@NEEDS_MOE_TRANSFORMERS
def test_verify_names_rules_that_miss_the_experts_module(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Per-expert rules only (what msquant wrote before): vLLM builds layer 1's FusedMoE
    quantized and fails on its float tensors; verify says so."""
    model = tiny_model_factory("qwen3_moe", **MOE_MODELS["qwen3_moe"])
    save = tmp_path / "out"
    _export(model, save, _config(exclude=["model.layers.1.mlp.experts.*"]))
    config = json.loads((save / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {
        rf"-:model\.layers\.1\.mlp\.experts\.{e}\.(?:gate_proj|up_proj|down_proj)$": {}
        for e in range(8)
    }
    (save / "config.json").write_text(json.dumps(config))
    errors = msquant.verify_export(save).errors
    assert [e for e in errors if "experts module's name" in e] == [
        "model.layers.1.mlp.experts: vLLM matches quantization_config.dynamic against the experts "
        "module's name and resolves it as int4 group 32 sym, but its 24 expert linear layers are "
        "stored "
        "in float (a rule matching the experts module name is missing)"
    ]


def test_experts_of_one_module_in_different_schemes_are_refused_by_the_saver() -> None:
    from msquant.processors.formats.gptq.config import dynamic_rules

    scheme = GPTQScheme(4, 32, True)
    units = [
        RuleUnit("model.layers.0", f"mlp\\.experts\\.{e}\\.down_proj", s,
                 f"model.layers.0.mlp.experts.{e}.down_proj",
                 (f"model.layers.0.mlp.experts.{e}.down_proj",), 64, 32)
        for e, s in ((0, scheme), (1, None))
    ]  # fmt: skip
    with pytest.raises(msquant.QuantizationError, match="model.layers.0.mlp.experts: its experts"):
        dynamic_rules(units, scheme)


# --- item 2: what transformers + optimum load randomly initialised -------------------------------


def _random_warning(messages: list[str]) -> str:
    [found] = [m for m in messages if "randomly initialised" in m]
    assert "GPTQModel.load" in found and "vLLM" in found and "compressed_tensors" in found
    return found


def test_a_quantized_head_warns_that_transformers_loads_it_random(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, SAVER_LOGGER)
    _export(tiny_llama, tmp_path / "out", _config(lm_head=True))
    assert "the quantized output head (lm_head)" in _random_warning(_warnings(caplog))
    warnings = msquant.verify_export(tmp_path / "out").warnings
    assert any("lm_head" in w and "randomly" in w for w in warnings)


@NEEDS_MOE_TRANSFORMERS
def test_quantized_moe_experts_warn_that_transformers_loads_them_random(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model_factory("mixtral", **MOE_MODELS["mixtral"])
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    _export(model, tmp_path / "out", _config())
    assert "the MoE experts" in _random_warning(_warnings(caplog))
    warnings = msquant.verify_export(tmp_path / "out").warnings
    assert any("MoE experts" in w and "randomly" in w for w in warnings)


def test_dense_exports_do_not_warn_about_random_weights(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    _export(tiny_llama, tmp_path / "out", _config())
    assert not [m for m in _warnings(caplog) if "randomly" in m]


# --- item 3: modules_in_block_to_quantize ---------------------------------------------------------

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
FUSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
SKIPS = {
    "every_down_proj": (["*down_proj"], [["self_attn.q_proj", "self_attn.k_proj",
                        "self_attn.v_proj"], ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"]]),
    "one_down_proj": (["model.layers.1.mlp.down_proj"], [["self_attn.q_proj", "self_attn.k_proj",
                      "self_attn.v_proj"], ["self_attn.o_proj"], ["mlp.gate_proj", "mlp.up_proj"],
                      ["model.layers.0.mlp.down_proj"]]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(SKIPS))
@pytest.mark.parametrize("head", [False, True])
def test_float_decoder_layers_are_listed_for_transformers_and_vllm(
    case: str, head: bool, tiny_llama: Path, tmp_path: Path
) -> None:
    """With only ``-:`` rules, optimum (which ignores ``dynamic``) and vLLM (which reads the list
    instead of the file metadata) quantize exactly the stored quantized layers."""
    exclude, expected = SKIPS[case]
    qc = _export(tiny_llama, tmp_path / "out", _config(exclude=exclude, lm_head=head))
    assert qc["modules_in_block_to_quantize"] == expected + ([["lm_head"]] if head else [])
    export = read_gptq_export(tmp_path / "out")
    for layer in ("model.layers.0", "model.layers.1"):
        for linear in LINEARS:
            name = f"{layer}.{linear}"
            assert optimum_quantized(qc, name) == (name in export.modules), name
            stored = export.modules.get(name)
            want = None if stored is None else BASE
            assert vllm_linear_scheme(qc, name) == want, name
        for fused in FUSED:  # vLLM checks every shard of a fused layer
            name = f"{layer}.{fused}"
            shard = name.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
            assert vllm_linear_scheme(qc, name) == (BASE if shard in export.modules else None)
    assert vllm_linear_scheme(qc, "lm_head") == (BASE if head else None)
    assert ("lm_head" in export.modules) == head
    assert msquant.verify_export(tmp_path / "out").ok


def test_fully_quantized_exports_carry_no_list(tiny_llama: Path, tmp_path: Path) -> None:
    qc = _export(tiny_llama, tmp_path / "out", _config(lm_head=True))
    assert "modules_in_block_to_quantize" not in qc  # every layer quantized: both read metadata


def test_a_relative_name_inside_a_float_layers_name_falls_back_to_full_names() -> None:
    """``mlp.down_proj`` also ends ``extra_mlp.down_proj`` (float): optimum and vLLM would
    quantize it, so the quantized layer is listed by its full name."""
    from msquant.processors.formats.gptq.config import modules_in_block_to_quantize

    scheme = GPTQScheme(4, 32, True)

    def unit(name: str, s: GPTQScheme | None) -> RuleUnit:
        return RuleUnit("model.layers.0", "", s, name, (name,), 64, 64)

    units = [
        unit("model.layers.0.mlp.down_proj", scheme),
        unit("model.layers.0.extra_mlp.down_proj", None),
        unit("model.layers.0.self_attn.o_proj", scheme),
    ]
    lists = modules_in_block_to_quantize(units)
    assert lists == [["model.layers.0.mlp.down_proj"], ["self_attn.o_proj"]]
    qc = {"modules_in_block_to_quantize": lists}
    assert not optimum_quantized(qc, "model.layers.0.extra_mlp.down_proj")
    assert optimum_quantized(qc, "model.layers.0.mlp.down_proj")


def test_verify_checks_the_list(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    _export(tiny_llama, save, _config(exclude=["*down_proj"]))
    config = json.loads((save / "config.json").read_text())
    qc = config["quantization_config"]

    def verify_with(value: object | None) -> list[str]:
        changed = dict(qc)
        if value is None:
            changed.pop("modules_in_block_to_quantize")
        else:
            changed["modules_in_block_to_quantize"] = value
        (save / "config.json").write_text(json.dumps({**config, "quantization_config": changed}))
        report = msquant.verify_export(save)
        return report.errors + report.warnings

    flat = ["self_attn.q_proj", "self_attn.k_proj"]
    assert any("must be a list of lists" in m for m in verify_with(flat))
    missing = verify_with([["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]])
    assert any(m.startswith("model.layers.0.self_attn.o_proj is stored quantized") for m in missing)
    extra = verify_with([*qc["modules_in_block_to_quantize"], ["mlp.down_proj"]])
    assert any(m.startswith("model.layers.0.mlp.down_proj is stored in float") for m in extra)
    assert any("fail at the first forward" in m for m in verify_with(None))


# --- item 4: a quantized head needs a vocabulary that is a multiple of 64 -------------------------


def test_head_vocabulary_not_a_multiple_of_64_is_checked_before_weights_load(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory("llama", vocab_size=400)
    plan = msquant.plugin.planning.build_plan(model, _config(lm_head=True))
    [warning] = [w for w in plan.warnings if "multiple of 64" in w]
    assert warning.startswith("gptq_saver: lm_head is quantized, but its 400 output rows")
    assert "vLLM and SGLang" in warning and plan.ok
    strict = _config(save={"strict": True}, lm_head=True)
    assert any(
        "gptq_saver (strict): lm_head" in e
        for e in msquant.plugin.planning.build_plan(model, strict).errors
    )
    with pytest.raises(msquant.QuantizationError, match="multiple of 64"):
        msquant.quantize(model, tmp_path / "out", strict, progress=False)
    assert not (tmp_path / "out").exists()
    assert not [
        w for w in msquant.plugin.planning.build_plan(model, _config()).warnings if "64" in w
    ]


def test_head_vocabulary_of_384_passes(tiny_llama: Path) -> None:
    plan = msquant.plugin.planning.build_plan(
        tiny_llama, _config(save={"strict": True}, lm_head=True)
    )
    assert plan.ok and not [w for w in plan.warnings if "multiple of 64" in w]


# --- item 5: the Marlin shape warning, per engine -------------------------------------------------


def test_marlin_warning_says_what_vllm_and_sglang_each_do(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    _export(tiny_llama, tmp_path / "tiles", _config())
    [tiles] = [m for m in _warnings(caplog) if "Marlin" in m]
    assert "vLLM 0.33 / 0.34 zero-pads them to whole tiles and loads the checkpoint" in tiles
    assert "do not serve this checkpoint with SGLang" in tiles
    assert "vLLM will not load" not in tiles and "refuses" not in tiles
    caplog.clear()
    _export(tiny_llama, tmp_path / "g16", _config({**W4_G32, "ext": {"group_size": 16}}))
    [groups] = [m for m in _warnings(caplog) if "Marlin" in m]
    assert "vLLM 0.33 / 0.34 refuses such layers" in groups and "group_size 16" in groups
    notes = msquant.verify_export(tmp_path / "tiles").warnings
    assert any("vLLM 0.33 / 0.34 zero-pads them" in w for w in notes)


def test_marlin_shape_notes_count_fused_layers_whole(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """gate_proj and up_proj 160 wide each are one gate_up_proj of 320 (whole Marlin tiles) in
    vLLM and SGLang; only down_proj, 160 inputs wide, is not a whole tile. The saver's warning
    and ``msquant verify``'s note name the same layers."""
    caplog.set_level(logging.WARNING, SAVER_LOGGER)
    model = tiny_model_factory("llama", hidden_size=128, intermediate_size=160)
    _export(model, tmp_path / "out", _config())
    [warning] = [m for m in _warnings(caplog) if "Marlin" in m]
    assert "model.layers.0.mlp.down_proj [out 128, in 160" in warning
    assert "gate" not in warning and "up_proj" not in warning
    [note] = [w for w in msquant.verify_export(tmp_path / "out").warnings if "Marlin" in w]
    assert "(2 layers: model.layers.0.mlp.down_proj, model.layers.1.mlp.down_proj)" in note
