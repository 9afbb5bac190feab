"""W4A16 Ascend exports, the MindIE file naming, fused-layer refusal, overwrite rules and runs
writing several formats at once; all read back through the independent test reader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CliResult
from safetensors.torch import load_file

import msquant
import msquant.plugin
import msquant.plugin.model
import msquant.plugin.numerics
from msquant import OutputPathError, QuantizationError


def config(
    dtype: str = "int8",
    scope: str = "per_channel",
    symmetric: bool = True,
    group_size: int | None = None,
    exclude: list[str] | None = None,
    save: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    weight: dict[str, Any] = {
        "dtype": dtype,
        "scope": scope,
        "symmetric": symmetric,
        "method": "minmax",
    }
    if group_size is not None:
        weight["ext"] = {"group_size": group_size}
    entry: dict[str, Any] = {"type": "linear_quant", "qconfig": {"weight": weight}}
    if exclude:
        entry["exclude"] = exclude
    return {"apiversion": "modelslim_v1", "spec": {"process": [entry], "save": save or []}}


@pytest.mark.parametrize(
    ("scope", "symmetric", "group_size"),
    [("per_channel", True, None), ("per_group", True, 32), ("per_group", False, 16)],
    ids=["per_channel_sym", "g32_sym", "g16_asym"],
)
def test_w4a16_export_packs_int4_pairs_and_dequantizes_exactly(
    scope: str, symmetric: bool, group_size: int | None, tiny_llama: Path, tmp_path: Path
) -> None:
    save = tmp_path / "out"
    msquant.quantize(tiny_llama, save, config("int4", scope, symmetric, group_size), progress=False)
    export = read_ascend_export(save)
    original = load_file(str(tiny_llama / "model.safetensors"))
    modules = export.quantized_modules()
    assert len(modules) == 14
    for module in modules:
        weight = original[f"{module}.weight"]
        out_features, in_features = weight.shape
        packed = export.tensors[f"{module}.weight"]
        assert packed.dtype == torch.int8 and tuple(packed.shape) == (
            out_features,
            in_features // 2,
        )
        groups = 1 if group_size is None else in_features // group_size
        assert tuple(export.tensors[f"{module}.weight_scale"].shape) == (out_features, groups)
        expected = msquant.plugin.numerics.quantize_weight_minmax(weight, 4, symmetric, group_size)
        assert torch.equal(export.codes(module), expected.codes.to(torch.int16))
        assert torch.equal(export.dequantized(module), expected.dequantize())
        for suffix in ("weight", "weight_scale", "weight_offset"):
            assert export.types[f"{module}.{suffix}"] == "W4A16"
    assert export.description["model_quant_type"] == "W4A16"
    assert export.description["group_size"] == (group_size or 0)


def test_w4a16_first_byte_is_packed_low_nibble_first(tiny_llama: Path, tmp_path: Path) -> None:
    """Byte-level: element 2i in the low nibble, 2i+1 in the high nibble (two's complement)."""
    msquant.quantize(tiny_llama, tmp_path / "out", config("int4"), progress=False)
    weights = load_file(str(tmp_path / "out" / "quant_model_weights-00001-of-00001.safetensors"))
    original = load_file(str(tiny_llama / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    codes = msquant.plugin.numerics.quantize_weight_minmax(
        original[f"{name}.weight"], 4, True, None
    ).codes
    packed = weights[f"{name}.weight"]
    for row, col in ((0, 0), (3, 5), (17, 31)):
        low, high = int(codes[row, 2 * col]), int(codes[row, 2 * col + 1])
        assert int(packed[row, col]) & 0xFF == (low & 0xF) | ((high & 0xF) << 4)


def test_mindie_saver_names_files_after_the_quant_type(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    msquant.quantize(
        tiny_llama, save, config(save=[{"type": "mindie_format_saver"}]), progress=False
    )
    names = sorted(p.name for p in save.iterdir())
    assert "quant_model_weight_w8a16.safetensors" in names
    assert "quant_model_description_w8a16.json" in names
    assert not [n for n in names if n.startswith("quant_model_weights") or "index" in n]
    export = read_ascend_export(
        save, "quant_model_weight_w8a16", "quant_model_description_w8a16.json"
    )
    assert export.description["model_quant_type"] == "W8A16"
    assert len(export.quantized_modules()) == 14


def test_mindie_json_append_overrides_type_and_adds_keys(tiny_llama: Path, tmp_path: Path) -> None:
    saver = {
        "type": "mindie_format_saver",
        "ext": {"json_append": {"model_quant_type": "W8A16", "note": "from msquant"}},
    }
    msquant.quantize(tiny_llama, tmp_path / "out", config("int4", save=[saver]), progress=False)
    description = json.loads((tmp_path / "out" / "quant_model_description_w8a16.json").read_text())
    assert description["model_quant_type"] == "W8A16" and description["note"] == "from msquant"
    assert description["model.layers.0.mlp.up_proj.weight"] == "W4A16"


def test_mindie_json_append_rejects_unknown_types(tiny_llama: Path, tmp_path: Path) -> None:
    saver = {"type": "mindie_format_saver", "ext": {"json_append": {"model_quant_type": "W3"}}}
    with pytest.raises(msquant.ConfigError) as info:
        msquant.quantize(tiny_llama, tmp_path / "out", config(save=[saver]), progress=False)
    assert "spec.save[0].ext.json_append.model_quant_type" in str(info.value)
    assert "W8A16" in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("exclude", "fused"),
    [(["*q_proj"], "self_attn.qkv_proj"), (["*layers.1.mlp.up_proj"], "mlp.gate_up_proj")],
)
def test_split_fused_layers_are_refused(
    exclude: list[str], fused: str, tiny_llama: Path, tmp_path: Path
) -> None:
    with pytest.raises(QuantizationError) as info:
        msquant.quantize(tiny_llama, tmp_path / "out", config(exclude=exclude), progress=False)
    message = str(info.value)
    assert fused in message and "not quantized (spec.process[0] exclude" in message
    assert "int8 per-channel sym by spec.process[0]" in message
    assert not (tmp_path / "out").exists()


def test_ascend_saver_refuses_split_fused_layers_itself(tiny_llama: Path) -> None:
    """Defence in depth: the saver checks each layer even when the run's pre-check is bypassed."""
    from transformers import AutoModelForCausalLM

    from msquant.plugin import DecoderLayer, QuantizedLinear
    from msquant.plugin.model import replace_module
    from msquant.processors.formats.ascend.saver import AscendV1Saver, AscendV1SaverConfig

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    layer = DecoderLayer(0, "model.layers.0", model.model.layers[0])
    for name, linear in layer.named_linears():
        if not name.endswith("q_proj"):
            qweight = msquant.plugin.numerics.quantize_weight_minmax(linear.weight, 4, True, None)
            replace_module(model, name, QuantizedLinear.from_linear(linear, qweight, "minmax"))
    saver = AscendV1Saver(AscendV1SaverConfig())
    with pytest.raises(QuantizationError) as info:
        saver.check_fused(layer.module, layer.name)
    assert "model.layers.0.self_attn.qkv_proj" in str(info.value)
    assert "q_proj: FLOAT" in str(info.value) and "k_proj: W4A16 per-channel sym" in str(info.value)


def test_fused_groups_resolve_shards_and_ignore_lone_layers() -> None:
    names = [
        "m.layers.0.self_attn.q_proj",
        "m.layers.0.self_attn.k_proj",
        "m.layers.0.self_attn.v_proj",
        "m.layers.0.self_attn.o_proj",
        "m.layers.0.mlp.gate_proj",
        "m.layers.0.mlp.up_proj",
        "m.layers.1.mlp.gate_proj",  # its up_proj is missing: nothing to fuse
    ]
    groups = msquant.plugin.model.fused_groups(names)
    assert [(g.fused_name, len(g.members)) for g in groups] == [
        ("m.layers.0.mlp.gate_up_proj", 2),
        ("m.layers.0.self_attn.qkv_proj", 3),
    ]
    schemes = dict.fromkeys(names, "W8A16")
    assert msquant.plugin.model.fused_group_problems(schemes) == []
    schemes["m.layers.0.self_attn.v_proj"] = "W4A16"
    [problem] = msquant.plugin.model.fused_group_problems(schemes)
    assert "m.layers.0.self_attn.qkv_proj" in problem and "v_proj: W4A16" in problem


def test_previous_export_is_replaced_only_with_overwrite(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    msquant.quantize(tiny_llama, save, config(), progress=False)
    before = {p.name: p.read_bytes() for p in save.iterdir()}
    with pytest.raises(OutputPathError, match="holds a previous export; pass --overwrite"):
        msquant.quantize(tiny_llama, save, config("int4"), progress=False)
    assert {p.name: p.read_bytes() for p in save.iterdir()} == before
    msquant.quantize(tiny_llama, save, config("int4"), progress=False, overwrite=True)
    assert read_ascend_export(save).description["model_quant_type"] == "W4A16"
    # unrelated files are never deleted, even with overwrite
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(OutputPathError, match="does not hold a previous export"):
        msquant.quantize(tiny_llama, tmp_path / "mine", config(), progress=False, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_overwrite_flag_on_the_cli(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    args = ["quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out"]
    args += ["--quant_type", "w8a16", "--no_progress"]
    assert run_cli(*args).code == 0
    refused = run_cli(*args)
    assert refused.code == 2 and "--overwrite" in refused.err
    assert run_cli(*args, "--overwrite").code == 0


def test_several_savers_write_one_subfolder_each(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    savers = [{"type": "ascendv1_saver", "part_file_size": 0}, {"type": "mindie_format_saver"}]
    msquant.quantize(tiny_llama, save, config(save=savers), progress=False)
    assert sorted(p.name for p in save.iterdir()) == [
        "ascendv1_saver",
        "mindie_format_saver",
        "msquant_export.json",
        "quant_report.json",
    ]
    marker = json.loads((save / "msquant_export.json").read_text())
    assert marker["savers"] == [
        {"type": "ascendv1_saver", "path": "ascendv1_saver"},
        {"type": "mindie_format_saver", "path": "mindie_format_saver"},
    ]
    first = read_ascend_export(save / "ascendv1_saver")
    second = read_ascend_export(
        save / "mindie_format_saver",
        "quant_model_weight_w8a16",
        "quant_model_description_w8a16.json",
    )
    assert first.description == second.description
    assert first.tensors.keys() == second.tensors.keys()
    assert all(torch.equal(first.tensors[k], second.tensors[k]) for k in first.tensors)
