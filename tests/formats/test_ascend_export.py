"""End-to-end runs of the minmax examples on tiny models, checked through an independent reader."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from ascend_reader import read_ascend_export
from conftest import EXAMPLES, CliResult
from safetensors.torch import load_file

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant.plugin.export import copy_model_files

MINMAX_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*minmax*.yaml"))


def _selected(name: str, spec: dict) -> bool:
    entry = spec["spec"]["process"][0]
    from fnmatch import fnmatchcase

    include = entry.get("include", ["*"])
    exclude = entry.get("exclude", [])
    return any(fnmatchcase(name, p) for p in include) and not any(
        fnmatchcase(name, p) for p in exclude
    )


def _weight_cfg(spec: dict) -> tuple[bool, int | None]:
    weight = spec["spec"]["process"][0]["qconfig"]["weight"]
    group = (
        weight.get("ext", {}).get("group_size", 128) if weight.get("scope") == "per_group" else None
    )
    return weight.get("symmetric", True), group


@pytest.mark.parametrize("example", MINMAX_EXAMPLES)
def test_minmax_example_export_matches_reference(
    example: str, tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    save = tmp_path / "out"
    result = run_cli(
        "quant",
        "--model_path",
        tiny_llama,
        "--save_path",
        save,
        "--config_path",
        EXAMPLES / example,
        "--no_progress",
    )
    assert result.code == 0, result.err
    spec = yaml.safe_load((EXAMPLES / example).read_text())
    symmetric, group_size = _weight_cfg(spec)
    original = load_file(str(tiny_llama / "model.safetensors"))
    export = read_ascend_export(save)

    linears = sorted(k[: -len(".weight")] for k in original if k.endswith("_proj.weight"))
    expected_q = [m for m in linears if _selected(m, spec)]
    assert sorted(export.quantized_modules()) == expected_q
    assert len(expected_q) > 0

    # exact description: every original tensor once, plus scale/offset of quantized layers
    expected_types = {k: "FLOAT" for k in original}
    for module in expected_q:
        expected_types.update(
            {f"{module}.{s}": "W8A16" for s in ("weight", "weight_scale", "weight_offset")}
        )
    assert export.types == expected_types
    assert set(export.tensors) == set(expected_types)
    assert export.description["version"] == "1.0.0"
    assert export.description["model_quant_type"] == "W8A16"
    assert export.description["group_size"] == (group_size or 0)
    assert export.description["metadata"] == {} and export.description["optional"] == {}

    for module in linears:
        w = original[f"{module}.weight"]
        if module not in expected_q:
            assert torch.equal(export.tensors[f"{module}.weight"], w)
            continue
        q, scale, offset = (
            export.tensors[f"{module}.{s}"] for s in ("weight", "weight_scale", "weight_offset")
        )
        groups = 1 if group_size is None else w.shape[1] // group_size
        assert q.dtype == torch.int8 and tuple(q.shape) == tuple(w.shape)
        assert scale.dtype == offset.dtype == torch.float32
        assert tuple(scale.shape) == tuple(offset.shape) == (w.shape[0], groups)
        if symmetric:
            assert torch.count_nonzero(offset) == 0
        # bit-for-bit equal to the in-memory fake-quantized weight
        in_memory = msquant.plugin.numerics.quantize_weight_minmax(w, 8, symmetric, group_size)
        assert torch.equal(q, in_memory.codes)
        assert torch.equal(export.dequantized(module), in_memory.dequantize())
    for name, tensor in original.items():
        if not name.endswith("_proj.weight"):
            assert (
                torch.equal(export.tensors[name], tensor)
                and export.tensors[name].dtype == tensor.dtype
            )

    # model files copied, the config used saved beside them
    assert json.loads((save / "config.json").read_text()) == json.loads(
        (tiny_llama / "config.json").read_text()
    )
    assert (save / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()
    assert (save / "llama_best_practice.yaml").read_text() == (EXAMPLES / example).read_text()
    assert not list(save.glob("*.tmp")) and not list(tmp_path.glob(".out.msquant-*"))


def test_per_channel_export_is_sharded_with_index(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    save = tmp_path / "out"
    assert (
        run_cli(
            "quant", "--model_path", tiny_llama, "--save_path", save, "--quant_type", "w8a16"
        ).code
        == 0
    )
    index = json.loads((save / "quant_model_weights.safetensors.index.json").read_text())
    shard = save / "quant_model_weights-00001-of-00001.safetensors"
    assert set(index["weight_map"].values()) == {shard.name}
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in load_file(str(shard)).values()
    )


def test_bf16_model_quantizes_and_keeps_float_tensors_in_bf16(
    tiny_llama_bf16: Path, tmp_path: Path
) -> None:
    config = yaml.safe_load((EXAMPLES / "w8a16_per_group_asym_minmax_skip_down.yaml").read_text())
    result = msquant.quantize(tiny_llama_bf16, tmp_path / "out", config, progress=False)
    export = read_ascend_export(tmp_path / "out")
    original = load_file(str(tiny_llama_bf16 / "model.safetensors"))
    assert len(result.quantized_modules) == 12  # 7 per layer minus down_proj, 2 layers
    q_proj = "model.layers.0.self_attn.q_proj"
    assert export.tensors[f"{q_proj}.weight_scale"].dtype == torch.float32
    assert export.tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert export.tensors["model.norm.weight"].dtype == torch.bfloat16
    expected = msquant.plugin.numerics.quantize_weight_minmax(
        original[f"{q_proj}.weight"].float(), 8, False, 32
    )
    assert torch.equal(export.dequantized(q_proj), expected.dequantize())


def test_quantization_config_is_removed_from_copied_config(tmp_path: Path) -> None:
    """As msModelSlim: vLLM-Ascend must not mistake the export for another quantization format."""
    source, target = tmp_path / "model", tmp_path / "out"
    source.mkdir()
    target.mkdir()
    config = {
        "hidden_size": 8,
        "quantization_config": {"quant_method": "fp8"},
        "text_config": {"quantization_config": {"quant_method": "fp8"}, "vocab_size": 3},
    }
    (source / "config.json").write_text(json.dumps(config))
    (source / "tokenizer.json").write_text("{}")
    (source / "model.safetensors.index.json").write_text("{}")
    (source / "chat_template.jinja").write_text("{{ messages }}")
    copied = copy_model_files(source, target)
    assert copied == ["chat_template.jinja", "config.json", "tokenizer.json"]
    written = json.loads((target / "config.json").read_text())
    assert written == {"hidden_size": 8, "text_config": {"vocab_size": 3}}
    assert json.loads((source / "config.json").read_text()) == config  # the source is untouched


def test_tied_embeddings_are_written_once_but_described(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory("llama", tie_word_embeddings=True)
    msquant.quantize(
        model, tmp_path / "out", EXAMPLES / "w8a16_per_channel_minmax.yaml", progress=False
    )
    export = read_ascend_export(tmp_path / "out")
    assert "model.embed_tokens.weight" in export.tensors
    assert "lm_head.weight" not in export.tensors
    assert export.description["lm_head.weight"] == "FLOAT"  # vLLM-Ascend looks the head up


def test_quantized_model_forward_is_close_to_float(tiny_llama: Path, tmp_path: Path) -> None:
    """Loading the dequantized export into the float model gives nearly the same logits."""
    from transformers import AutoModelForCausalLM

    msquant.quantize(
        tiny_llama, tmp_path / "out", EXAMPLES / "w8a16_per_channel_minmax.yaml", progress=False
    )
    export = read_ascend_export(tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    ids = torch.arange(1, 40).unsqueeze(0)
    with torch.no_grad():
        reference = model(ids).logits
        state = model.state_dict()
        for module in export.quantized_modules():
            state[f"{module}.weight"].copy_(export.dequantized(module))
        quantized = model(ids).logits
    rel = ((quantized - reference).norm() / reference.norm()).item()
    assert 0 < rel < 0.02, rel
