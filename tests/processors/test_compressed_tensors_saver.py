"""The compressed-tensors export, checked by the real client and by an independent reader.

Exports of the tiny Llama are loaded with ``transformers.AutoModelForCausalLM.from_pretrained`` on
CPU (compressed-tensors installed: symmetric with the default loader, asymmetric with
``CompressedTensorsConfig(dequantize=True)``) and their logits are compared with the original
model whose quantized linears hold the fake-quantized weights computed independently here.

Measured (max |logit diff| / max |logit|): float32 model 0.0 for every scheme; bfloat16 model
6e-3 to 9e-3 against the float32-scale reference (the format stores scales in bf16, whose rounding
alone moves the logits that much) and 0.0 against the same reference with bf16-rounded scales.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors import QuantizationConfig
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant.processors.formats.compressed_tensors.config import (
    COMPRESSED_TENSORS_VERSION,
    WeightScheme,
    build_quantization_config,
)
from msquant.processors.formats.compressed_tensors.consumers import transformers_loading_note
from msquant.processors.formats.compressed_tensors.packer import pack_quantized_tensors

# transformers warns that the checkpoint's quantization_config wins over the passed loading options
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")

IDS = torch.tensor([[1, 5, 17, 42, 99, 200, 301, 7, 64, 128, 3, 250]])
LAYERS = 2
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEARS = [
    f"model.layers.{i}.{block}.{proj}"
    for i in range(LAYERS)
    for block, projs in (("self_attn", ATTN), ("mlp", MLP))
    for proj in projs
]

# name -> (bits, symmetric, group_size)
SCHEMES: dict[str, tuple[int, bool, int | None]] = {
    "w8a16_channel_sym": (8, True, None),
    "w8a16_group32_asym": (8, False, 32),
    "w4a16_group32_sym": (4, True, 32),
    "w4a16_group32_asym": (4, False, 32),
}


def _entry(
    bits: int, symmetric: bool, group_size: int | None, **selection: list[str]
) -> dict[str, Any]:
    weight: dict[str, Any] = {
        "dtype": f"int{bits}",
        "scope": "per_channel" if group_size is None else "per_group",
        "symmetric": symmetric,
        "method": "minmax",
    }
    if group_size is not None:
        weight["ext"] = {"group_size": group_size}
    return {"type": "linear_quant", "qconfig": {"weight": weight}, **selection}


def _config(*entries: dict[str, Any], **saver: Any) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": list(entries), "save": [{"type": "compressed_tensors", **saver}]},
    }


def _export(model: Path, save: Path, config: dict[str, Any]) -> Path:
    """Run the pipeline (including msquant's own read-back check of the export)."""
    msquant.quantize(model, save, config, progress=False)
    return save


def _read_tensors(save: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(save.glob("model*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _quantization_config(save: Path) -> dict[str, Any]:
    config = json.loads((save / "config.json").read_text())["quantization_config"]
    assert isinstance(config, dict)
    return config


def unpack_int32(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Independent reader: ``count`` unsigned ``bits``-wide values from LSB-first int32 words (last
    dim), value ``i`` at bits ``[i*bits, (i+1)*bits)`` of the concatenated words."""
    stream = words.to(torch.int64) & 0xFFFFFFFF
    values = []
    for i in range(count):
        word, shift = divmod(i * bits, 32)
        value = stream[..., word] >> shift
        if shift + bits > 32:
            value = value | (stream[..., word + 1] << (32 - shift))
        values.append(value & (2**bits - 1))
    return torch.stack(values, dim=-1)


@functools.cache
def _original_model(model_dir: Path) -> nn.Module:
    """The float model, loaded once per folder (callers modify deep copies)."""
    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def _reference_logits(
    model_dir: Path,
    schemes: dict[str, tuple[int, bool, int | None]],
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits of the original model whose listed linears hold their fake-quantized weights.

    :param scale_dtype: round the scales through this dtype first (what the export stores).
    """
    model = copy.deepcopy(_original_model(model_dir))
    with torch.no_grad():
        for name, (bits, symmetric, group_size) in schemes.items():
            linear = model.get_submodule(name)
            assert isinstance(linear, nn.Linear)
            q = msquant.plugin.numerics.quantize_weight_minmax(
                linear.weight, bits, symmetric, group_size
            )
            if scale_dtype is not None:
                scale = q.scale.to(scale_dtype).float()
                q = msquant.plugin.QuantizedWeight(
                    q.codes, scale, q.offset, bits, symmetric, group_size
                )
            linear.weight.copy_(q.dequantize().to(linear.weight.dtype))
        return model(IDS).logits.float()


def _client_logits(save: Path, symmetric: bool) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    if not symmetric:
        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(str(save), **kwargs)
    with torch.no_grad():
        return model(IDS).logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def export_scheme(
    tiny_llama: Path, tiny_llama_bf16: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str, str], tuple[Path, Path]]]:
    """Export (once) the float32 or bf16 tiny Llama with one of SCHEMES, every linear quantized."""
    models = {"float32": tiny_llama, "bfloat16": tiny_llama_bf16}
    cache: dict[tuple[str, str], Path] = {}

    def export(dtype: str, scheme: str) -> tuple[Path, Path]:
        if (dtype, scheme) not in cache:
            save = tmp_path_factory.mktemp(f"ct_{dtype}_{scheme}") / "out"
            cache[dtype, scheme] = _export(models[dtype], save, _config(_entry(*SCHEMES[scheme])))
        return models[dtype], cache[dtype, scheme]

    yield export


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_float32_export_with_fake_quant_logits(
    scheme: str, export_scheme: Callable[[str, str], tuple[Path, Path]]
) -> None:
    model_dir, save = export_scheme("float32", scheme)
    bits, symmetric, group_size = SCHEMES[scheme]
    reference = _reference_logits(model_dir, dict.fromkeys(LINEARS, SCHEMES[scheme]))
    logits = _client_logits(save, symmetric)
    assert _rel(logits, reference) <= 1e-3
    # quantization is visible (the reference is not just the float model)
    float_logits = _reference_logits(model_dir, {})
    assert _rel(reference, float_logits) > 1e-4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_bf16_export(
    scheme: str, export_scheme: Callable[[str, str], tuple[Path, Path]]
) -> None:
    """bf16 scales: tight against the bf16-scale reference, within scale rounding otherwise."""
    model_dir, save = export_scheme("bfloat16", scheme)
    schemes = dict.fromkeys(LINEARS, SCHEMES[scheme])
    logits = _client_logits(save, SCHEMES[scheme][1])
    assert logits.abs().max() > 0.1
    assert _rel(logits, _reference_logits(model_dir, schemes, torch.bfloat16)) <= 1e-3
    assert _rel(logits, _reference_logits(model_dir, schemes)) <= 2e-2  # measured 6e-3..9e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_export_layout_config_and_packed_codes(
    scheme: str, dtype: str, export_scheme: Callable[[str, str], tuple[Path, Path]]
) -> None:
    model_dir, save = export_scheme(dtype, scheme)
    bits, symmetric, group_size = SCHEMES[scheme]
    model_dtype = getattr(torch, dtype)

    config = _quantization_config(save)
    parsed = QuantizationConfig.model_validate(config)  # compressed-tensors' own model
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False}
    if group_size is None:
        weights["strategy"] = "channel"
    else:
        weights.update(strategy="group", group_size=group_size)
    assert config == {
        "quant_method": "compressed-tensors",
        "version": COMPRESSED_TENSORS_VERSION,
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
    }
    args = parsed.config_groups["group_0"].weights
    assert args is not None and args.num_bits == bits and args.group_size == group_size

    original = load_file(str(model_dir / "model.safetensors"))
    tensors = _read_tensors(save)
    index = json.loads((save / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    suffixes = ["weight_packed", "weight_scale", "weight_shape"]
    if not symmetric:
        suffixes.append("weight_zero_point")
    expected_names = {n for n in original if n.removesuffix(".weight") not in LINEARS}
    expected_names |= {f"{m}.{s}" for m in LINEARS for s in suffixes}
    assert set(tensors) == expected_names
    for name in expected_names & set(original):
        assert tensors[name].dtype == original[name].dtype
        assert torch.equal(tensors[name], original[name])

    for module in LINEARS:
        w = original[f"{module}.weight"]
        out_features, in_features = w.shape
        groups = 1 if group_size is None else in_features // group_size
        expected = msquant.plugin.numerics.quantize_weight_minmax(w, bits, symmetric, group_size)
        packed = tensors[f"{module}.weight_packed"]
        assert packed.dtype == torch.int32
        assert tuple(packed.shape) == (out_features, -(-in_features * bits // 32))
        codes = unpack_int32(packed, bits, in_features)
        assert torch.equal(codes, expected.codes.to(torch.int64) + 2 ** (bits - 1))
        scale = tensors[f"{module}.weight_scale"]
        assert scale.dtype == model_dtype and tuple(scale.shape) == (out_features, groups)
        assert torch.equal(scale, expected.scale.to(model_dtype))
        shape = tensors[f"{module}.weight_shape"]
        assert shape.dtype == torch.int64 and shape.tolist() == [out_features, in_features]
        if not symmetric:
            zero = tensors[f"{module}.weight_zero_point"]
            assert zero.dtype == torch.int32
            assert tuple(zero.shape) == (-(-out_features * bits // 32), groups)
            zero_points = unpack_int32(zero.T, bits, out_features).T
            assert torch.equal(zero_points, expected.offset.to(torch.int64) + 2 ** (bits - 1))


def test_mixed_precision_is_several_groups_and_loads(
    tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Attention int8 per-channel, gate/up int4 group 32, down_proj left float (ignored)."""
    config = _config(
        _entry(8, True, None, include=["*self_attn*"]),
        _entry(4, True, 32, include=["*gate_proj", "*up_proj"]),
        part_file_size=0,
    )
    save = _export(tiny_llama, tmp_path / "out", config)
    assert (save / "model.safetensors").is_file()
    assert not (save / "model.safetensors.index.json").exists()

    written = _quantization_config(save)
    QuantizationConfig.model_validate(written)
    mlp_int4 = [m for m in LINEARS if m.endswith(("gate_proj", "up_proj"))]
    groups = written["config_groups"]
    assert list(groups) == ["group_0", "group_1"]
    assert groups["group_0"]["targets"] == mlp_int4
    assert groups["group_0"]["weights"]["num_bits"] == 4
    assert groups["group_0"]["weights"]["group_size"] == 32
    assert groups["group_1"]["targets"] == ["Linear"]
    assert groups["group_1"]["weights"]["num_bits"] == 8
    assert groups["group_1"]["weights"]["strategy"] == "channel"
    assert written["ignore"] == [m for m in LINEARS if m.endswith("down_proj")] + ["lm_head"]

    schemes: dict[str, tuple[int, bool, int | None]] = {
        **{m: (8, True, None) for m in LINEARS if ".self_attn." in m},
        **dict.fromkeys(mlp_int4, (4, True, 32)),
    }
    with caplog.at_level(logging.WARNING, logger="compressed_tensors"):
        logits = _client_logits(save, symmetric=True)
    # exact-name groups precede the Linear group, so compressed-tensors reaches every target
    assert not [r for r in caplog.records if "Could not match" in r.getMessage()]
    assert _rel(logits, _reference_logits(tiny_llama, schemes)) <= 1e-3
    # every linear with its own scheme: the int8 reference for gate/up would not match
    wrong = {**schemes, **dict.fromkeys(mlp_int4, (8, True, None))}
    assert _rel(logits, _reference_logits(tiny_llama, wrong)) > 1e-3


def test_tied_head_and_bias_are_written_in_model_dtype(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama", tie_word_embeddings=True, attention_bias=True)
    save = _export(model_dir, tmp_path / "out", _config(_entry(4, True, 32)))
    tensors = _read_tensors(save)
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    bias = tensors["model.layers.0.self_attn.q_proj.bias"]
    original = load_file(str(model_dir / "model.safetensors"))
    assert bias.dtype == torch.float32
    assert torch.equal(bias, original["model.layers.0.self_attn.q_proj.bias"])
    assert _quantization_config(save)["ignore"] == ["lm_head"]
    logits = _client_logits(save, symmetric=True)
    reference = _reference_logits(model_dir, dict.fromkeys(LINEARS, (4, True, 32)))
    assert _rel(logits, reference) <= 1e-3


@pytest.mark.parametrize(
    ("entries", "messages"),
    [
        (
            [_entry(4, True, 32, exclude=["*v_proj"])],
            [
                "model.layers.0.self_attn.qkv_proj",
                "v_proj: not quantized (spec.process[0] exclude *v_proj)",
                "q_proj: int4 group 32 sym by spec.process[0]",
            ],
        ),
        (
            [
                _entry(4, True, 32, include=["*q_proj", "*gate_proj"]),
                _entry(8, True, None, include=["*k_proj", "*v_proj", "*up_proj"]),
            ],
            [
                "model.layers.0.self_attn.qkv_proj",
                "model.layers.0.mlp.gate_up_proj",
                "q_proj: int4 group 32 sym by spec.process[0]",
                "k_proj: int8 per-channel sym by spec.process[1]",
            ],
        ),
    ],
    ids=["skipped_shard", "different_schemes"],
)
def test_fused_shards_must_share_one_scheme(
    entries: list[dict[str, Any]], messages: list[str], tiny_llama: Path, tmp_path: Path
) -> None:
    save = tmp_path / "out"
    with pytest.raises(msquant.QuantizationError) as info:
        _export(tiny_llama, save, _config(*entries))
    for message in messages:
        assert message in str(info.value)
    assert not save.exists()  # nothing written to the save path


def test_nothing_quantized_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    """Refused before weights load by the plan (the saver's own check stays as a second line)."""
    with pytest.raises(msquant.QuantizationError, match="the config quantizes none of the model"):
        _export(tiny_llama, tmp_path / "out", _config(_entry(8, True, None, exclude=["*"])))
    assert not (tmp_path / "out").exists()


def _qweight(
    codes: list[list[int]], bits: int, scale: float = 0.5
) -> msquant.plugin.QuantizedWeight:
    data = torch.tensor(codes, dtype=torch.int8)
    params = torch.full((data.shape[0], 1), scale)
    return msquant.plugin.QuantizedWeight(data, params, torch.zeros_like(params), bits, True, None)


def test_packed_words_by_hand() -> None:
    """4-bit codes -8..7 become unsigned 0..15, eight per word, lowest nibble first."""
    qweight = _qweight([list(range(-8, 8)), [0] * 16], 4)
    tensors = pack_quantized_tensors("p", qweight, None, torch.float32)
    words = [[0x76543210, 0xFEDCBA98 - 2**32], [0x88888888 - 2**32] * 2]
    assert tensors["p.weight_packed"].tolist() == words
    assert tensors["p.weight_shape"].tolist() == [2, 16]
    assert set(tensors) == {"p.weight_packed", "p.weight_scale", "p.weight_shape"}

    # 3-bit, 11 values: dense, value 10 straddles words 0 and 1 (bits 30..32)
    three = _qweight([[3, -4, 0, 1, -1, 2, -3, 3, 0, 0, 3]], 3)
    packed = pack_quantized_tensors("p", three, None, torch.float32)["p.weight_packed"]
    assert tuple(packed.shape) == (1, 2)
    unsigned = [c + 4 for c in [3, -4, 0, 1, -1, 2, -3, 3, 0, 0, 3]]
    stream = sum(v << (3 * i) for i, v in enumerate(unsigned))
    expected = [stream & 0xFFFFFFFF, stream >> 32]
    assert (packed.to(torch.int64) & 0xFFFFFFFF).tolist() == [expected]


def test_asymmetric_zero_points_pack_along_output_dim() -> None:
    codes = torch.zeros(9, 4, dtype=torch.int8)
    scale = torch.ones(9, 2)
    offset = torch.arange(-4, 5, dtype=torch.float32).unsqueeze(1).repeat(1, 2)  # -4..4 per row
    qweight = msquant.plugin.QuantizedWeight(codes, scale, offset, 4, False, 2)
    zero = pack_quantized_tensors("p", qweight, None, torch.bfloat16)["p.weight_zero_point"]
    assert zero.dtype == torch.int32 and tuple(zero.shape) == (2, 2)
    assert torch.equal(unpack_int32(zero.T, 4, 9).T, (offset + 8).to(torch.int64))
    assert (zero[0].to(torch.int64) & 0xFFFFFFFF).tolist() == [0xBA987654] * 2


@pytest.mark.parametrize(
    ("scale", "dtype"), [(1e-9, torch.float16), (1e6, torch.float16), (1e-45, torch.bfloat16)]
)
def test_scale_not_representable_in_model_dtype_is_refused(
    scale: float, dtype: torch.dtype
) -> None:
    qweight = _qweight([[1, 2]], 8, scale)
    with pytest.raises(
        msquant.QuantizationError, match=r"model\.layers\.3\.mlp\.up_proj: 1 weight"
    ):
        pack_quantized_tensors("model.layers.3.mlp.up_proj", qweight, None, dtype)


def test_bit_widths_outside_2_to_8_are_refused() -> None:
    with pytest.raises(msquant.QuantizationError, match="p: .* 2-8 bit weights, got int1"):
        pack_quantized_tensors("p", _qweight([[0, -1]], 1), None, torch.float32)


def test_non_integer_zero_point_is_refused() -> None:
    qweight = msquant.plugin.QuantizedWeight(
        torch.zeros(1, 2, dtype=torch.int8),
        torch.ones(1, 1),
        torch.full((1, 1), 0.5),
        8,
        False,
        None,
    )
    with pytest.raises(msquant.QuantizationError, match="p: offsets must be integers"):
        pack_quantized_tensors("p", qweight, None, torch.float32)


def test_config_groups_for_three_schemes_validate_in_compressed_tensors() -> None:
    a, b, c = WeightScheme(4, True, 32), WeightScheme(8, False, None), WeightScheme(2, False, 16)
    schemes = {"m.a1": a, "m.b1": b, "m.a2": a, "m.c1": c, "m.b2": b, "m.b3": b}
    config = build_quantization_config(schemes, ["lm_head"])
    groups = config["config_groups"]
    assert [g["targets"] for g in groups.values()] == [["m.a1", "m.a2"], ["m.c1"], ["Linear"]]
    parsed = QuantizationConfig.model_validate(config)
    strategies = [g.weights.strategy for g in parsed.config_groups.values() if g.weights]
    assert strategies == ["group", "group", "channel"]
    assert groups["group_2"]["weights"] == {
        "num_bits": 8,
        "type": "int",
        "symmetric": False,
        "strategy": "channel",
        "dynamic": False,
    }
    with pytest.raises(msquant.QuantizationError, match="no linear layer was quantized"):
        build_quantization_config({}, ["lm_head"])


@pytest.mark.parametrize(
    ("saver", "path"),
    [
        ({"part_file_size": -1}, "spec.save[0].part_file_size"),
        ({"shard_size": 1}, "spec.save[0].shard_size"),
    ],
)
def test_saver_config_is_validated(saver: dict[str, Any], path: str) -> None:
    with pytest.raises(msquant.ConfigError) as info:
        msquant.validate_config(
            _config(_entry(8, True, None), **saver), msquant.plugin.default_registry()
        )
    assert path in [issue.path for issue in info.value.issues]


def test_transformers_loading_note_names_the_loader() -> None:
    sym, asym = WeightScheme(4, True, 32), WeightScheme(8, False, None)
    assert "from_pretrained(path)" in transformers_loading_note([sym, WeightScheme(8, True, None)])
    assert "dequantize=True" in transformers_loading_note([asym, asym])
    assert "cannot load" in transformers_loading_note([sym, asym])
