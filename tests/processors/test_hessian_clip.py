"""``method: hessian_clip`` (activation-aware clipping, AWQ's clip search on the Hessian): the
search against a float64 reference written one group at a time, its guarantee (a row's output
error never above min/max's), and a YAML run through the method registry."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CliResult

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant import QuantizationError
from msquant.plugin.numerics import (
    compute_qparams,
    hessian_clip_qparams,
    qrange,
    quantize_weight_hessian_clip,
    relative_output_errors,
)
from msquant.quant.mse_clip import shrink_factors


def _layer(out: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A heavy-tailed weight (Student t, 3 dof) and activations whose columns differ in scale
    by up to 30x (as LLM activations do), as ``(weight, X^T X)``."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(out, width, generator=gen, dtype=torch.float64)
    chi2 = sum(torch.randn(out, width, generator=gen, dtype=torch.float64) ** 2 for _ in range(3))
    weight = (normal / torch.sqrt(chi2 / 3) * 0.02).float()
    x = torch.randn(512, width, generator=gen) * torch.logspace(-0.7, 0.8, width)
    return weight, x.t() @ x


def _reference(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    sym: bool,
    width: int,
    grid: int,
    shrink: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The search in float64, one row-group at a time: first strict minimum of d^T H_gg d."""
    qmin, qmax = qrange(bits)
    out, columns = weight.shape
    h = hessian.double()
    scales = torch.zeros(out, columns // width)
    offsets = torch.zeros(out, columns // width)
    for row in range(out):
        for g in range(columns // width):
            cols = slice(g * width, (g + 1) * width)
            w = weight[row, cols].double()
            block = h[cols, cols]
            best = None
            for p in shrink_factors(grid, shrink):
                s, o = compute_qparams(w.min() * p, w.max() * p, bits, sym)
                q = torch.clamp(torch.round(w / s.double() + o.double()), qmin, qmax)
                d = (q - o.double()) * s.double() - w
                error = float(d @ block @ d)
                if best is None or error < best[0]:
                    best = (error, float(s), float(o))
            assert best is not None
            scales[row, g], offsets[row, g] = best[1], best[2]
    return scales, offsets


@pytest.mark.parametrize(
    ("bits", "sym", "group"), [(4, True, 16), (4, False, None), (8, False, 32)]
)
def test_the_search_matches_the_float64_reference(bits: int, sym: bool, group: int | None) -> None:
    weight, hessian = _layer(8, 64, seed=bits)
    width = 64 if group is None else group
    ref_scale, ref_offset = _reference(weight, hessian, bits, sym, width, 10, 0.5)
    scale, offset = hessian_clip_qparams(
        weight, hessian, bits, sym, group, grid=10, maxshrink=0.5, dtype=torch.float64
    )
    assert torch.equal(scale, ref_scale) and torch.equal(offset, ref_offset)
    fast, _ = hessian_clip_qparams(weight, hessian, bits, sym, group, grid=10, maxshrink=0.5)
    other_choice = (fast - ref_scale).abs() > 1e-5 * ref_scale  # not float32 rounding of p * max
    assert int(other_choice.sum()) <= max(1, fast.numel() // 50)  # float32 near-ties
    doubled, _ = hessian_clip_qparams(weight, 2 * hessian, bits, sym, group, 10, 0.5, torch.float64)
    assert torch.equal(doubled, scale)  # any positive multiple of X^T X chooses alike


def test_a_rows_output_error_never_exceeds_min_max() -> None:
    """Per-channel, the searched error is the row's exact output error and p = 1 (min/max) is a
    candidate: no row gets worse. Measured at int4 on heavy-tailed weights, the layer's relative
    output error drops well below min/max's."""
    weight, hessian = _layer(64, 128, seed=5)
    clipped = quantize_weight_hessian_clip(weight, hessian, 4, True).dequantize()
    rtn = msquant.plugin.numerics.quantize_weight_minmax(weight, 4, True, None).dequantize()
    for row in range(64):
        d_clip, d_rtn = clipped[row] - weight[row], rtn[row] - weight[row]
        assert float(d_clip @ hessian @ d_clip) <= float(d_rtn @ hessian @ d_rtn) * (1 + 1e-5)
    clip_error, rtn_error = relative_output_errors(weight, [clipped, rtn], hessian)
    assert clip_error < 0.9 * rtn_error, (clip_error, rtn_error)
    mse = msquant.plugin.numerics.quantize_weight_minmax(
        weight, 4, True, None, mse=msquant.plugin.numerics.MSEOptions()
    )
    (mse_error,) = relative_output_errors(weight, [mse.dequantize()], hessian)
    assert clip_error < mse_error  # weighing columns by their activations beats plain MSE here


def test_a_hessian_of_another_layer_is_refused() -> None:
    weight, _ = _layer(4, 64)
    with pytest.raises(QuantizationError, match=r"down_proj: Hessian \(32, 32\) does not match"):
        quantize_weight_hessian_clip(weight, torch.eye(32), 8, True, name="down_proj")


def test_a_yaml_run_clips_where_it_lowers_the_output_error(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """int4 per-channel: the run (which reads its exports back) succeeds, each module's report
    entry shows an output error at most its min/max baseline's, and some module is clipped."""
    weight = {"method": "hessian_clip", "dtype": "int4", "ext": {"clip_grid": 10}}
    spec = {
        "process": [{"type": "linear_quant", "qconfig": {"weight": weight}}],
        "save": [{"type": "ascendv1_saver"}, {"type": "compressed_tensors"}],
    }
    config = tmp_path / "clip.yaml"
    config.write_text(yaml.safe_dump({"spec": spec}))
    out = tmp_path / "out"
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", out, "--config_path", config,
        "--calib_path", Path(__file__).parents[1] / "data" / "calib.txt",
    )  # fmt: skip
    assert result.code == 0, result.err
    modules = json.loads((out / "quant_report.json").read_text())["modules"]
    assert modules and {m["method"] for m in modules} == {"hessian_clip"}
    for module in modules:
        assert module["output_error"] <= module["rtn_output_error"] * (1 + 1e-4), module
        assert module["tokens"] > 0
    assert any(m["output_error"] < 0.99 * m["rtn_output_error"] for m in modules)
    bad = tmp_path / "bad.yaml"
    bad.write_text(config.read_text().replace("clip_grid: 10", "clip_grid: 0"))
    refused = run_cli("validate", bad)
    assert (
        refused.code == 2
        and "qconfig.weight.ext.clip_grid: Input should be greater than 0" in refused.err
    )
