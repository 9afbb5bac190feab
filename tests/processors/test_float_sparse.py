"""``float_sparse`` (msModelSlim's W16A16S): the ADMM numerics against a float64 reference of the
same definition, the Ascend export read back and verified, and the refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CALIB_TXT
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import msquant
from msquant import ConfigError, load_config_text, verify_export
from msquant.plugin import default_registry
from msquant.processors.sparse.admm import (
    DAMP,
    ITERATIONS,
    MASK_ITERATIONS,
    InputStats,
    admm_prune,
    pruned_count,
    round_mantissa,
    sparsify,
)


def _reference_admm(weight: torch.Tensor, x: torch.Tensor, ratio: float) -> torch.Tensor:
    """The ADMM definition of msquant.processors.sparse.admm in float64, written plainly."""
    w = weight.double()
    h = x.double().T @ x.double()
    d = h.diagonal().sqrt() + 1e-8
    hn = h / torch.outer(d, d)
    wn = (w * d).T
    hn = hn + DAMP * hn.diagonal().mean() * torch.eye(len(d), dtype=torch.float64)
    b = hn @ wn
    inv = torch.linalg.inv(hn + torch.eye(len(d), dtype=torch.float64))
    u = torch.zeros_like(wn)
    mask = torch.ones_like(wn, dtype=torch.bool)
    k = int(wn.numel() * ratio)
    for it in range(ITERATIONS):
        if it < MASK_ITERATIONS:
            order = (wn + u).abs().flatten().argsort()
            mask = torch.ones(wn.numel(), dtype=torch.bool)
            mask[order[:k]] = False
            mask = mask.reshape(wn.shape)
        z = (wn + u) * mask
        u = u + wn - z
        wn = inv @ (b + z - u)
    return ((wn + u) * mask).T / d


def _correlated(tokens: int, features: int, seed: int) -> torch.Tensor:
    """Inputs with strongly correlated columns and unequal scales."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=gen) / features**0.5
    mix = mix + 2.0 * torch.ones(features, features) / features
    scale = torch.logspace(-1, 1, features)
    return (torch.randn(tokens, features, generator=gen) @ mix) * scale


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.4, 0.75])
def test_admm_matches_float64_reference_and_ratio(ratio: float) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 32, generator=gen)
    x = _correlated(256, 32, seed=2)
    stats = InputStats(32)
    stats.add(x.reshape(4, 64, 32))
    pruned = admm_prune(weight, stats.hessian, ratio)
    reference = _reference_admm(weight, x, ratio)
    assert pruned.dtype == torch.float32 and pruned.shape == weight.shape
    # the masks agree (the float32 and float64 runs choose the same entries) ...
    assert torch.equal(pruned == 0, reference == 0)
    assert int((pruned == 0).sum()) == pruned_count(weight.numel(), ratio)
    # ... and the kept values to float32 accuracy of the normalized solve
    torch.testing.assert_close(pruned.double(), reference, rtol=1e-3, atol=1e-4)


def _objective(weight: torch.Tensor, pruned: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x.double() @ (weight.double() - pruned.double()).T) ** 2).sum())


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_admm_beats_magnitude_pruning_on_correlated_inputs(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(16, 48, generator=gen)
    x = _correlated(512, 48, seed=seed + 10)
    stats = InputStats(48)
    stats.add(x)
    ratio = 0.5
    pruned = admm_prune(weight, stats.hessian, ratio)
    k = pruned_count(weight.numel(), ratio)
    magnitude = weight.clone().flatten()
    magnitude[weight.abs().flatten().argsort()[:k]] = 0
    magnitude = magnitude.reshape(weight.shape)
    assert _objective(weight, pruned, x) < _objective(weight, magnitude, x)


def test_input_stats_accumulate_hessian_and_column_energy() -> None:
    gen = torch.Generator().manual_seed(6)
    batches = [torch.randn(2, 5, 8, generator=gen), torch.randn(1, 3, 8, generator=gen)]
    stats = InputStats(8)
    for batch in batches:
        stats.add(batch)
    flat = torch.cat([b.reshape(-1, 8) for b in batches]).double()
    torch.testing.assert_close(stats.hessian.double(), flat.T @ flat, rtol=1e-5, atol=1e-5)
    per_sample = torch.cat([(b.double() ** 2).sum(1) for b in batches])  # [samples, in]
    # msModelSlim's running mean: each batch adds its summed energy over the samples seen so far
    assert stats.samples == 3
    torch.testing.assert_close(
        stats.column_energy.double(), per_sample.sum(0) / 3, rtol=1e-5, atol=1e-6
    )


def _two_bit(value: float) -> float:
    """float64 reference of the 2-mantissa-bit rounding of one float16 value."""
    if value == 0:
        return 0.0
    mag = abs(value)
    exponent = int(torch.tensor(mag).log2().floor())
    if exponent < -14:
        return 0.0
    if exponent < -8:
        return (2.0 ** (exponent + 1) if mag / 2.0**exponent > 1.5 else 2.0**exponent) * (
            1 if value > 0 else -1
        )
    mantissa = mag / 2.0**exponent
    rounded = float(torch.tensor(mantissa * 4).round()) / 4  # round half to even
    return rounded * 2.0**exponent * (1 if value > 0 else -1)


def test_round_mantissa_against_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    values = torch.cat(
        [
            torch.randn(200, generator=gen) * 3,
            torch.randn(50, generator=gen) * 1e-3,  # exponents -14..-9
            torch.tensor([0.0, 1.125, 1.375, -1.625, 2.0**-20, 3e-3, -6.1e-5]),
        ]
    ).to(torch.float16)
    keep = torch.zeros_like(values, dtype=torch.bool)
    keep[:10] = True
    out = round_mantissa(values, keep)
    assert out.dtype == torch.float16
    for i, (v, o) in enumerate(zip(values.double().tolist(), out.double().tolist(), strict=True)):
        expected = v if i < 10 and abs(v) >= 2.0**-14 else _two_bit(v)
        assert o == expected, (i, v, o, expected)


def test_sparsify_keeps_dtype_ratio_and_two_percent_full_precision() -> None:
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    stats = InputStats(64)
    stats.add(_correlated(128, 64, seed=9).reshape(2, 64, 64))
    out = sparsify(weight, stats, 0.4)
    assert out.dtype == torch.bfloat16 and out.shape == weight.shape
    assert int((out == 0).sum()) >= pruned_count(weight.numel(), 0.4)
    nonzero = out[out != 0].to(torch.float16)
    coarse = round_mantissa(nonzero)
    exact_share = float((coarse != nonzero).double().mean())
    assert 0 < exact_share <= 0.02 * weight.numel() / nonzero.numel() + 1e-9


def _sparse_config(ratio: float = 0.4, **extra: object) -> dict:
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "float_sparse", "sparse_ratio": ratio, **extra}],
            "save": [{"type": "ascendv1_saver", "part_file_size": 0}],
        },
    }


def test_export_reloads_typed_w16a16s_and_verifies(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3")
    out = tmp_path / "out"
    msquant.quantize(
        model_dir,
        out,
        _sparse_config(exclude=["*.mlp.down_proj"]),
        calib_path=CALIB_TXT,
        progress=False,
    )
    tensors = load_file(str(out / "quant_model_weights.safetensors"))
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description["model_quant_type"] == "W16A16S"
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    linears = [n for n, m in original.named_modules() if isinstance(m, torch.nn.Linear)]
    pruned = [n for n in linears if ".layers." in n and not n.endswith("down_proj")]
    assert pruned
    for name in linears:
        key = f"{name}.weight"
        if name in pruned:
            assert description[key] == "W16A16S"
            weight = tensors[key]
            assert weight.dtype == original.get_submodule(name).weight.dtype
            assert int((weight == 0).sum()) >= pruned_count(weight.numel(), 0.4)
        else:
            assert description[key] == "FLOAT"
            assert torch.equal(tensors[key], original.get_submodule(name).weight)
    report = verify_export(out, model_path=model_dir)
    assert report.ok, report.errors
    # the pruned weights are not compared with the original's, nor is the model's function
    assert report.forward is None
    assert any("forward check" in w and "W16A16S" not in w for w in report.warnings)


def test_verify_rejects_w16a16s_on_a_non_linear_tensor(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3")
    out = tmp_path / "out"
    msquant.quantize(model_dir, out, _sparse_config(), calib_path=CALIB_TXT, progress=False)
    path = out / "quant_model_description.json"
    description = json.loads(path.read_text())
    norm = next(k for k in description if k.endswith("input_layernorm.weight"))
    description[norm] = "W16A16S"
    path.write_text(json.dumps(description))
    report = verify_export(out)
    assert f"{norm} (W16A16S): expected a 2-d float tensor, stored torch.float32 [64]" in (
        report.errors
    ), report.errors


def test_sparse_ratio_out_of_range_names_the_yaml_path() -> None:
    text = (
        "apiversion: modelslim_v1\nspec:\n  process:\n    - type: float_sparse\n"
        "      sparse_ratio: 1.5\n  save:\n    - type: ascendv1_saver\n"
    )
    with pytest.raises(
        ConfigError, match=r"spec\.process\[0\]\.sparse_ratio.*1\.5 is outside \[0, 1\]"
    ):
        load_config_text(text, default_registry())


def test_saver_without_w16a16s_refuses(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3")
    cfg = _sparse_config()
    cfg["spec"]["save"] = [{"type": "mindie_format_saver", "part_file_size": 0}]
    with pytest.raises(
        msquant.QuantizationError, match=r"W16A16S tensor, which this format does not store"
    ):
        msquant.quantize(model_dir, tmp_path / "out", cfg, calib_path=CALIB_TXT, progress=False)


def test_qwen2_biases_typed_w16a16s_unchanged(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """msModelSlim's W16A16S linear keeps its bias (typed W16A16S, as its saver writes it)."""
    model_dir = tiny_model_factory("qwen2")
    out = tmp_path / "out"
    msquant.quantize(model_dir, out, _sparse_config(0.5), calib_path=CALIB_TXT, progress=False)
    tensors = load_file(str(out / "quant_model_weights.safetensors"))
    description = json.loads((out / "quant_model_description.json").read_text())
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    biases = [k for k in description if k.endswith("q_proj.bias")]
    assert biases
    for key in biases:
        assert description[key] == "W16A16S"
        assert torch.equal(tensors[key], original[key])
    assert verify_export(out).ok


def test_a_later_entry_quantizing_pruned_linears_is_refused(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3")
    cfg = _sparse_config()
    cfg["spec"]["process"].append(
        {
            "type": "linear_quant",
            "qconfig": {
                "weight": {
                    "scope": "per_channel",
                    "dtype": "int8",
                    "symmetric": True,
                    "method": "minmax",
                }
            },
            "include": ["*"],
        }
    )
    with pytest.raises(
        msquant.QuantizationError, match=r"float_sparse: model\.layers\.0\..* replaced by a later"
    ):
        msquant.quantize(model_dir, tmp_path / "out", cfg, calib_path=CALIB_TXT, progress=False)
