"""``fa3_quant`` (msModelSlim's FA3): the recall-window numerics against a float64 brute force,
exports of a tiny DeepSeek-V3 reloaded and their scales recomputed from a float64 model, the
description strings, verify's checks of FAQuant records, and the refusals (unimplemented dtypes
and scopes, unknown attention classes, no saver writing the scales)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import MLA_DEEPSEEK_V3
from transformers import AutoModelForCausalLM, AutoTokenizer

import msquant
from msquant import ConfigError, QuantizationError
from msquant.processors.fa3.numerics import (
    FP8_E4M3_MAX,
    fp8_e4m3_fake_quant,
    per_head_fp8_scale,
    per_head_int8_scale,
    per_token_fp8_fake_quant,
    recall_window,
)
from msquant.processors.formats.ascend.fa_quant import (
    parse_point_quant_type,
    point_quant_type,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Attention layers compress keys and values into one latent per token.",
    "Static scales come from calibration, dynamic ones from each token.",
]
W8A8_DYNAMIC = {
    "type": "linear_quant",
    "qconfig": {
        "act": {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"},
        "weight": {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"},
    },
    "include": ["*self_attn*"],
    "exclude": ["*kv_b_proj"],
}
PER_TOKEN = {"dtype": "int8", "scope": "per_token", "symmetric": True, "method": "minmax"}
FP8_PER_TOKEN = {**PER_TOKEN, "dtype": "fp8_e4m3"}
FP8_PER_HEAD = {**FP8_PER_TOKEN, "scope": "per_head"}
#: msModelSlim's DeepSeek-V3.1-Terminus / Kimi-K2.6 c8 practices' entry: the query float8 per
#: token (dynamic), the latent's key and value float8 per head (static).
FP8_DETAILS = {"fa_q": FP8_PER_TOKEN, "fa_k": FP8_PER_HEAD, "fa_v": FP8_PER_HEAD}
SAVER = {"type": "ascendv1_saver", "part_file_size": 0}


def cfg(*process: dict[str, Any], save: dict[str, Any] = SAVER) -> dict[str, Any]:
    return {"apiversion": "modelslim_v1", "spec": {"process": list(process), "save": [save]}}


def _brute_window(row: list[float], ratio: float) -> tuple[float, float]:
    """The definition: the narrowest window of int(ratio * n) sorted values, first on ties."""
    ordered = sorted(row)
    size = int(ratio * len(ordered))
    best = min(
        range(len(ordered) - size + 1), key=lambda i: (ordered[i + size - 1] - ordered[i], i)
    )
    return ordered[best], ordered[best + size - 1]


@pytest.mark.parametrize("ratio", [0.9999, 1.0, 0.5, 0.9])
def test_recall_window_is_the_narrowest_window_float64(ratio: float) -> None:
    torch.manual_seed(0)
    samples = torch.randn(5, 301, dtype=torch.float64) * torch.rand(5, 1, dtype=torch.float64)
    samples[1, :40] = 0.25  # ties
    samples[2, 7] = 40.0  # an outlier the window drops
    low, high = recall_window(samples, ratio)
    expected = [_brute_window(row, ratio) for row in samples.tolist()]
    assert low.tolist() == [e[0] for e in expected]
    assert high.tolist() == [e[1] for e in expected]
    if ratio == 0.9999:
        assert high[2].item() < 40.0


def test_recall_window_refuses_a_window_without_sample() -> None:
    with pytest.raises(ValueError, match="holds no sample"):
        recall_window(torch.zeros(2, 1), 0.9999)


def test_per_head_scale_is_the_symmetric_int8_scale() -> None:
    low = torch.tensor([-2.54, 0.5, -0.0, -1e-12])
    high = torch.tensor([1.0, 3.81, 0.0, 1e-12])
    expected = [
        2.54 / 127,
        3.81 / 127,
        torch.finfo(torch.float32).eps,
        torch.finfo(torch.float32).eps,
    ]
    assert per_head_int8_scale(low, high).tolist() == pytest.approx(expected, rel=1e-7)


def test_per_head_fp8_scale_is_the_magnitude_over_448_float64() -> None:
    low = torch.tensor([-2.54, 0.5, -0.0, -1e-13, -7.0], dtype=torch.float64)
    high = torch.tensor([1.0, 3.81, 0.0, 1e-14, -8.0], dtype=torch.float64)
    expected = [2.54 / 448, 3.81 / 448, 1e-12 / 448, 1e-12 / 448, 8.0 / 448]
    scale = per_head_fp8_scale(low, high)
    assert scale.dtype == torch.float64
    assert scale.tolist() == pytest.approx(expected, rel=1e-15)
    assert FP8_E4M3_MAX == max(_E4M3_TABLE) == 448


#: OCP FP8 e4m3's non-negative finite values in code order (the definition: exponent bias 7,
#: 3 mantissa bits, subnormals at exponent 0, code 0x7F NaN), in float64.
_E4M3_TABLE = [
    (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    for e in range(16)
    for m in range(8)
    if (e, m) != (15, 7)
]


def _nearest_e4m3(values: list[float]) -> list[float]:
    """The definition: each value clamped to [-448, 448], then the nearest e4m3 value (float64
    table of the format's values), ties to the even code (even mantissa)."""
    table = _E4M3_TABLE
    out = []
    for value in values:
        magnitude = min(abs(value), 448.0)
        best = min(range(len(table)), key=lambda i: (abs(table[i] - magnitude), i % 2))
        out.append(-table[best] if value < 0 else table[best])
    return out


def test_fp8_fake_quant_rounds_to_the_nearest_e4m3_value_float64() -> None:
    torch.manual_seed(0)
    scale = torch.tensor([[0.5], [2.0], [1e-3]], dtype=torch.float64)
    x = torch.randn(3, 200, dtype=torch.float64) * torch.tensor([[300.0], [900.0], [0.01]])
    # exact values, ties to even (8.5 -> 8, 9.5 -> 10, 1.0625 -> 1, 1.1875 -> 1.25), a subnormal
    # and a tie below the smallest one, 464 (-> 448)
    grid = [1.0, 1.125, 448.0, 464.0, 2**-9, 2**-10, 3 * 2**-10, 8.5, 9.5, 1.0625, 1.1875]
    x[0, : len(grid)] = torch.tensor(grid, dtype=torch.float64) * 0.5
    x[1, 0] = 5000.0  # clamped to 448
    got = fp8_e4m3_fake_quant(x, scale)
    expected = [
        [v * s for v in _nearest_e4m3([u / s for u in row])]
        for row, s in zip(x.tolist(), scale[:, 0].tolist(), strict=True)
    ]
    assert got.tolist() == expected
    assert got[1, 0].item() == 448.0 * 2.0
    assert (got[0, 7:11] / 0.5).tolist() == [8.0, 10.0, 1.0, 1.25]
    rows = torch.randn(4, 3, 5, 16, dtype=torch.float64)
    per_token = per_token_fp8_fake_quant(rows)
    flat = rows.reshape(-1, 16)
    steps = flat.abs().amax(dim=1, keepdim=True) / 448
    reference = [
        [v * s for v in _nearest_e4m3([u / s for u in row])]
        for row, s in zip(flat.tolist(), steps[:, 0].tolist(), strict=True)
    ]
    assert per_token.reshape(-1, 16).tolist() == reference


@pytest.mark.parametrize(
    ("schemes", "text"),
    [
        ({"Q": ("INT8", False), "K": ("INT8", False), "V": ("INT8", False)}, "INT8"),
        ({"Q": ("INT8", True), "K": ("INT8", True), "V": ("INT8", True)}, "INT8_DYNAMIC"),
        ({"Q": ("INT8", True), "K": ("INT8", True)}, "QK_INT8_DYNAMIC"),
        (
            {"Q": ("INT8", False), "K": ("INT8", True), "V": ("INT8", True)},
            "Q_INT8_KV_INT8_DYNAMIC",
        ),
        ({"Q": ("FP8", True), "K": ("FP8", False), "V": ("FP8", False)}, "Q_FP8_DYNAMIC_KV_FP8"),
        ({"Q": ("FP8", False), "K": ("FP8", False), "V": ("FP8", False)}, "FP8"),
    ],
)
def test_point_quant_type_strings(schemes: dict[str, tuple[str, bool]], text: str) -> None:
    assert point_quant_type(schemes) == text
    assert parse_point_quant_type(text) == schemes


# --- runs on a tiny DeepSeek-V3 --------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("deepseek_v3", **MLA_DEEPSEEK_V3)


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n", encoding="utf-8")
    return path


def _quantize_like_the_export(model: Any, export: Path) -> None:
    """Make ``model``'s W8A8_DYNAMIC linears (those the export holds int8 weights for) compute as
    deployed: the dequantized int8 weight, and each token of the input rounded to its own
    symmetric int8 grid (float64; the definition, not msquant's code)."""
    tensors = load_file(export / "quant_model_weights.safetensors")
    for name, module in model.named_modules():
        if tensors.get(f"{name}.weight", torch.empty(0)).dtype != torch.int8:
            continue
        codes, scale = tensors[f"{name}.weight"].double(), tensors[f"{name}.weight_scale"].double()
        module.weight.data = codes * scale

        def per_token(_m: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            x = args[0]
            step = x.abs().amax(dim=-1, keepdim=True) / 127
            return (torch.clamp(torch.round(x / step), -128, 127) * step,)

        module.register_forward_pre_hook(per_token)


def _reference_ranges(
    model_path: Path, quantized_by: Path | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per attention and branch, the running recall-window range over the samples, from a
    float64 copy of the model and the brute-force window (each sample on its own); with
    ``quantized_by``, through the linears that export quantized (:func:`_quantize_like_the_export`)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    if quantized_by is not None:
        _quantize_like_the_export(model, quantized_by)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ranges: dict[str, list[list[tuple[float, float]]]] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        heads, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim

        def on_query(
            _m: Any,
            _a: Any,
            q: torch.Tensor,
            attn: Any = attn,
            index: int = index,
            heads: int = heads,
            nope: int = nope,
            rope: int = rope,
        ) -> None:
            q_nope = q.unflatten(-1, (heads, nope + rope))[..., :nope]  # (b, s, h, nope)
            absorb = attn.kv_b_proj.weight.unflatten(0, (heads, -1))[:, :nope, :]  # (h, nope, r)
            fa_q = torch.einsum("bshn,hnr->hbsr", q_nope, absorb).flatten(1)
            ranges.setdefault(f"{index}.fa_q", []).append(
                [_brute_window(row, 0.9999) for row in fa_q.tolist()]
            )

        def on_latent(_m: Any, _a: Any, kv: torch.Tensor, index: int = index) -> None:
            flat = kv.flatten()[None].tolist()
            ranges.setdefault(f"{index}.fa_k", []).append([_brute_window(r, 0.9999) for r in flat])
            ranges.setdefault(f"{index}.fa_v", []).append([_brute_window(r, 1.0) for r in flat])

        hooks += [
            attn.q_b_proj.register_forward_hook(on_query),
            attn.kv_a_layernorm.register_forward_hook(on_latent),
        ]
    with torch.no_grad():
        for text in TEXTS:
            model(tokenizer(text, return_tensors="pt")["input_ids"])
    for hook in hooks:
        hook.remove()
    out = {}
    for key, per_sample in ranges.items():
        lows = torch.tensor([[w[0] for w in sample] for sample in per_sample], dtype=torch.float64)
        highs = torch.tensor([[w[1] for w in sample] for sample in per_sample], dtype=torch.float64)
        out[key] = (lows.min(0).values, highs.max(0).values)
    return out


def test_per_head_scales_match_a_float64_reference(
    deepseek: Path, calib: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    msquant.quantize(
        deepseek, out, cfg({"type": "fa3_quant"}, W8A8_DYNAMIC), calib_path=calib, progress=False
    )
    tensors = load_file(out / "quant_model_weights.safetensors")
    description = json.loads((out / "quant_model_description.json").read_text())
    for key, (low, high) in _reference_ranges(deepseek).items():
        layer, branch = key.split(".")
        name = f"model.layers.{layer}.self_attn.{branch}"
        scale, offset = tensors[f"{name}.scale"], tensors[f"{name}.offset"]
        heads = 4 if branch == "fa_q" else 1
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (heads, 1)
        assert offset.dtype == torch.int8 and tuple(offset.shape) == (heads, 1)
        assert not offset.any()
        expected = torch.maximum(-low.clamp(max=0), high.clamp(min=0)) / 127
        torch.testing.assert_close(scale[:, 0].double(), expected, rtol=1e-5, atol=0)
        assert description[f"{name}.scale"] == description[f"{name}.offset"] == "FAQuant"
    assert description["model.layers.0.self_attn.quant_type"] == "INT8"
    assert description["fa_quant_type"] == "FAKQuant"
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    assert msquant.verify_export(out, forward=False).ok

    # verify reads the records: a wrong shape, a missing global key
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    del description["fa_quant_type"]
    description["model.layers.1.self_attn.quant_type"] = "INT8_DYNAMIC"
    (broken / "quant_model_description.json").write_text(json.dumps(description))
    errors = "\n".join(msquant.verify_export(broken, forward=False).errors)
    assert "global fa_quant_type is None, expected 'FAKQuant'" in errors
    assert "model.layers.1.self_attn.quant_type does not name Q as a static branch" in errors


def test_after_linear_quant_it_observes_the_quantized_linears(
    deepseek: Path, calib: Path, tmp_path: Path
) -> None:
    """``fa3_quant`` after ``linear_quant`` in ``spec.process`` (the shipped DeepSeek-V3 files'
    order) observes the attention through the quantized linears, in every layer on the outputs of
    the quantized layers before it, as msModelSlim runs its entries; listed first, it observes
    the float layers."""
    out = tmp_path / "out"
    process = ({**W8A8_DYNAMIC}, {"type": "fa3_quant"})
    msquant.quantize(deepseek, out, cfg(*process), calib_path=calib, progress=False)
    tensors = load_file(out / "quant_model_weights.safetensors")
    quantized = _reference_ranges(deepseek, quantized_by=out)
    float_ = _reference_ranges(deepseek)
    moved = 0.0
    for key, (low, high) in quantized.items():
        layer, branch = key.split(".")
        scale = tensors[f"model.layers.{layer}.self_attn.{branch}.scale"][:, 0].double()
        expected = torch.maximum(-low.clamp(max=0), high.clamp(min=0)) / 127
        torch.testing.assert_close(scale, expected, rtol=1e-5, atol=0)
        low, high = float_[key]
        from_float = torch.maximum(-low.clamp(max=0), high.clamp(min=0)) / 127
        moved = max(moved, float(((scale - from_float).abs() / from_float).max()))
    assert moved > 1e-4  # the quantized linears moved the scales: the test tells them apart


def test_fp8_details_export_the_float8_scales_float64(
    deepseek: Path, calib: Path, tmp_path: Path
) -> None:
    """msModelSlim's DeepSeek-V3.1 / Kimi-K2.6 entry: ``fa_q`` float8 per token (no tensor),
    ``fa_k`` / ``fa_v`` float8 per head: scale ``max |range| / 448`` from the float64 reference
    range, float32 zero offsets, ``Q_FP8_DYNAMIC_KV_FP8``; verify reads the records."""
    out = tmp_path / "out"
    entry = {"type": "fa3_quant", "details": FP8_DETAILS, "include": ["*"]}
    msquant.quantize(deepseek, out, cfg(entry, W8A8_DYNAMIC), calib_path=calib, progress=False)
    tensors = load_file(out / "quant_model_weights.safetensors")
    description = json.loads((out / "quant_model_description.json").read_text())
    assert sorted(n for n in tensors if ".fa_" in n) == sorted(
        f"model.layers.{i}.self_attn.{b}.{leaf}"
        for i in (0, 1)
        for b in ("fa_k", "fa_v")
        for leaf in ("scale", "offset")
    )
    for key, (low, high) in _reference_ranges(deepseek).items():
        layer, branch = key.split(".")
        if branch == "fa_q":
            continue
        name = f"model.layers.{layer}.self_attn.{branch}"
        scale, offset = tensors[f"{name}.scale"], tensors[f"{name}.offset"]
        assert scale.dtype == offset.dtype == torch.float32
        assert tuple(scale.shape) == tuple(offset.shape) == (1, 1)
        assert not offset.any()
        expected = torch.maximum(low.abs(), high.abs()) / 448
        torch.testing.assert_close(scale[:, 0].double(), expected, rtol=1e-5, atol=0)
        assert description[f"{name}.scale"] == description[f"{name}.offset"] == "FAQuant"
    for layer in (0, 1):
        assert description[f"model.layers.{layer}.self_attn.quant_type"] == "Q_FP8_DYNAMIC_KV_FP8"
    assert description["fa_quant_type"] == "FAKQuant"
    assert msquant.verify_export(out, forward=False).ok

    # an FP8 branch's offset is float32: int8 zeros (the INT8 layout) are reported
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    tensors["model.layers.0.self_attn.fa_k.offset"] = torch.zeros(1, 1, dtype=torch.int8)
    save_file(tensors, broken / "quant_model_weights.safetensors")
    errors = "\n".join(msquant.verify_export(broken, forward=False).errors)
    assert "fa_k.offset: torch.int8 [1, 1], expected torch.float32 [heads, 1]" in errors


def test_per_token_exports_no_tensor(deepseek: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = cfg(
        {"type": "fa3_quant", "qconfig": PER_TOKEN, "exclude": ["model.layers.0.*"]}, W8A8_DYNAMIC
    )
    msquant.quantize(deepseek, out, config, progress=False)  # data-free: no calibration
    tensors = load_file(out / "quant_model_weights.safetensors")
    description = json.loads((out / "quant_model_description.json").read_text())
    assert not [name for name in tensors if ".fa_" in name]
    assert description["model.layers.1.self_attn.quant_type"] == "INT8_DYNAMIC"
    assert "model.layers.0.self_attn.quant_type" not in description
    assert "fa_quant_type" not in description


def test_no_saver_writing_the_scales_is_refused(
    deepseek: Path, calib: Path, tmp_path: Path
) -> None:
    config = cfg({"type": "fa3_quant"}, save={"type": "gptq_saver"})
    config["spec"]["process"].append(
        {"type": "linear_quant", "qconfig": {"weight": {"dtype": "int8", "method": "minmax"}}}
    )
    with pytest.raises(QuantizationError, match="no saver of this run writes FA3 scales"):
        msquant.quantize(deepseek, tmp_path / "out", config, calib_path=calib, progress=False)


def test_an_unknown_attention_is_refused_by_name(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(
        Exception, match=r"model\.layers\.0\.self_attn is a .*LlamaAttention"
    ) as info:
        msquant.quantize(tiny_llama, tmp_path / "out", cfg({"type": "fa3_quant"}), progress=False)
    assert "no FA3 adapter" in str(info.value)


# --- validation --------------------------------------------------------------------------------


def _issues(entry: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        msquant.validate_config(cfg(entry), msquant.plugin.default_registry())
    return {issue.path: issue.message for issue in info.value.issues}


@pytest.mark.parametrize(
    ("qconfig", "path", "words"),
    [
        (
            {**PER_TOKEN, "dtype": "mxfp8", "scope": "per_block"},
            "qconfig.dtype",
            "dtype mxfp8 is not implemented",
        ),
        ({**FP8_PER_TOKEN, "scope": "per_block"}, "qconfig.scope", "scope per_block is not"),
        (
            {**PER_TOKEN, "dtype": "mxfp4", "scope": "per_block"},
            "qconfig.dtype",
            "dtype mxfp4 is not implemented",
        ),
        (
            {**PER_TOKEN, "scope": "per_tensor"},
            "qconfig.scope",
            "scope per_tensor is not implemented",
        ),
        ({**PER_TOKEN, "symmetric": False}, "qconfig.symmetric", "symmetric only"),
    ],
)
def test_unimplemented_schemes_are_refused(qconfig: dict[str, Any], path: str, words: str) -> None:
    found = _issues({"type": "fa3_quant", "qconfig": qconfig})
    assert list(found) == [f"spec.process[0].{path}"]
    assert words in found[f"spec.process[0].{path}"]
    if "dtype" in path:
        assert "issue 26" in found[f"spec.process[0].{path}"]


def test_qconfig_and_details_are_exclusive() -> None:
    found = _issues({"type": "fa3_quant", "qconfig": PER_TOKEN, "details": {"fa_q": PER_TOKEN}})
    assert "exclusive" in found["spec.process[0].details"]
