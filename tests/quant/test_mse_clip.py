"""The MSE clipping search for scales: against a float64 brute force, in RTN and in GPTQ, in YAML.

The oracle (:func:`brute_force_mse`) loops over every row/group and every shrink factor in float64
with msModelSlim's formulas written out again; msquant's search is float32 and vectorised. Chosen
scales agree within 1e-6 relative (measured: 1.1e-7 at most), offsets are equal.

Measured on the layers below (the assertions keep a margin against them; ratios are mse / plain):

* weight error ``sum |w - w_q|^2.4`` per row/group, 24x256 with a moderate outlier (1.5x the rest of
  its block) in every third row: int4 sym per-channel 0.60-0.81 on the outlier rows, int4 asym
  0.76-0.96, int3 sym 0.55-0.67, int3 asym 0.59-0.74, int3 sym group 64 0.49-0.76 (every outlier
  row/group strictly better). int8 changes few rows (sym: 12-18% of rows, outlier rows not at all
  per-channel) and none asymmetric: one grid step of 255 is too fine for clipping to pay;
* RTN output error on held-out rows (64x128 layer with outliers): int4 sym per-channel 0.854,
  int4 sym group 32 0.865, int4 asym per-channel 0.923, int8 sym group 32 0.985. Not asserted:
  int8 sym per-channel 1.016 (the search minimises the weight error, not the output error);
* GPTQ held-out output error on the same layer: int4 sym 0.886-0.925 (per-channel, act-order,
  dynamic groups, static groups, act-order groups), int8 sym 0.981-1.002, int4 asym 0.952-0.977,
  but 1.012 with static groups and 1.014 with act-order groups. Over 8 seeds of a similar layer
  int4 sym stayed below 0.978 and int8 sym below 1.017, while int4 asym with static groups reached
  1.036, so the <= 1.02 bound is asserted for symmetric configs (int4 sym must also gain 2%), and
  asymmetric ones must run and move the scales.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from ascend_reader import read_ascend_export
from conftest import CALIB_TXT

import msquant
import msquant.plugin
from msquant import QuantizationError
from msquant.load.model_folder import load_causal_lm
from msquant.processors.methods.gptq import GPTQExt
from msquant.processors.methods.minmax import MinMaxExt
from msquant.quant.gptq import GPTQ_EXT_DEFAULTS, WeightPerChannelGPTQ, WeightPerGroupGPTQ
from msquant.quant.int_quant import dequantize, minmax_qparams, qrange, quantize
from msquant.quant.minmax import quantize_weight_minmax
from msquant.quant.mse_clip import (
    MSEOptions,
    mse_minmax_qparams,
    mse_qparams,
    shrink_factors,
)

NORM = 2.4
W = "spec.process[0].qconfig.weight"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Small tensors: a second thread only adds stalls when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- helpers ------------------------------------------------------------------------------------


def brute_force_mse(
    weight: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None,
    grid: int = 100,
    maxshrink: float = 0.2,
    norm: float = NORM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64, one row/group and one shrink factor at a time: the best ``(scale, offset)``."""
    w = weight.double()
    rows, cols = w.shape
    width = cols if group_size is None else group_size
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    eps = float(torch.finfo(torch.float32).eps)
    steps = max(i for i in range(grid) if i / grid <= maxshrink + 1e-12)  # 1 - maxshrink included
    scale = torch.empty(rows, cols // width, dtype=torch.float64)
    offset = torch.empty_like(scale)
    for r in range(rows):
        for g in range(cols // width):
            chunk = w[r, g * width : (g + 1) * width]
            low, high = min(float(chunk.min()), 0.0), max(float(chunk.max()), 0.0)
            best = math.inf
            for i in range(steps + 1):
                p = 1.0 - i / grid
                lo, hi = p * low, p * high
                if symmetric:
                    s, o = max(max(-lo, hi) / qmax, eps), 0.0
                else:
                    s = max((hi - lo) / (2**bits - 1), eps)
                    o = float(round(-lo / s)) + qmin
                q = torch.clamp(torch.round(chunk / s + o), qmin, qmax)
                err = float(((q - o) * s - chunk).abs().pow(norm).sum())
                if err < best:
                    best, scale[r, g], offset[r, g] = err, s, o
    return scale, offset


def weight_error(
    weight: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int | None,
    norm: float = NORM,
) -> torch.Tensor:
    """``sum |w - w_q|^norm`` of every row/group (float64) under float32 parameters."""
    codes = quantize(weight, scale.float(), offset.float(), bits, group_size)
    diff = dequantize(codes, scale.float(), offset.float(), group_size).double() - weight.double()
    rows, cols = weight.shape
    width = cols if group_size is None else group_size
    return diff.abs().pow(norm).reshape(rows, cols // width, width).sum(-1)


def with_outliers(
    weight: torch.Tensor, width: int, seed: int, factor: float = 1.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every third row gets, in each ``width`` block, one value ``factor`` x the block's max |w|.

    :returns: the new weight and the mask ``[rows, cols // width]`` of blocks with an outlier.
    """
    gen = torch.Generator().manual_seed(seed)
    rows, cols = weight.shape
    weight = weight.clone()
    blocks = weight.view(rows, cols // width, width)
    mask = torch.zeros(rows, cols // width, dtype=torch.bool)
    mask[::3] = True
    for r, g in mask.nonzero().tolist():
        col = int(torch.randint(0, width, (1,), generator=gen))
        sign = 1.0 if float(torch.rand(1, generator=gen)) < 0.5 else -1.0
        blocks[r, g, col] = sign * factor * float(blocks[r, g].abs().max())
    return weight, mask


def random_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def synthetic_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 64x128 weight with outliers (per 32 columns), calibration and held-out activations."""
    gen = torch.Generator().manual_seed(seed)
    in_features = 128
    decay = torch.exp(-torch.arange(in_features) / (in_features / 4))
    mixing = torch.randn(in_features, in_features, generator=gen) * decay
    x = torch.randn(2048, in_features, generator=gen) @ mixing.t()
    x += 0.1 * torch.randn(2048, in_features, generator=gen)
    x[:, :3] *= 10.0
    weight = torch.randn(64, in_features, generator=gen) * 0.05
    weight, _ = with_outliers(weight, 32, seed)
    return weight, x[:1024], x[1024:]


def output_error(x: torch.Tensor, weight: torch.Tensor, fake: torch.Tensor) -> float:
    """``||X W^T - X Q^T|| / ||X W^T||`` in float64."""
    x, weight, fake = x.double(), weight.double(), fake.double()
    return float(torch.linalg.norm(x @ (weight - fake).t()) / torch.linalg.norm(x @ weight.t()))


# -- the search against the float64 brute force ----------------------------------------------------


def test_shrink_factors() -> None:
    default = shrink_factors(100, 0.2)
    assert len(default) == 21 and default[0] == 1.0 and default[-1] == pytest.approx(0.8)
    assert shrink_factors(10, 0.25) == pytest.approx([1.0, 0.9, 0.8])
    assert shrink_factors(3, 0.2) == [1.0]  # a grid coarser than maxshrink: plain min/max only
    assert len(shrink_factors(1000, 0.9)) == 901
    with pytest.raises(ValueError, match="grid must be an int between 1 and 1000, got 1001"):
        shrink_factors(1001, 0.2)  # a billion steps once spun for hours


BRUTE_CASES = [
    (bits, symmetric, group, options)
    for bits in (8, 4, 3)
    for symmetric in (True, False)
    for group in (None, 16)
    for options in [MSEOptions()]
] + [
    (4, True, None, MSEOptions(grid=20, maxshrink=0.5, norm=2.0)),
    (4, False, 16, MSEOptions(grid=7, maxshrink=0.45, norm=1.0)),
]


@pytest.mark.parametrize(("bits", "symmetric", "group", "options"), BRUTE_CASES)
def test_search_matches_float64_brute_force(
    bits: int, symmetric: bool, group: int | None, options: MSEOptions
) -> None:
    weight, _ = with_outliers(random_weight(24, 64, seed=bits), group or 64, seed=bits)
    weight[5] = 0.0  # all-zero row: every candidate is the eps scale, p = 1 is kept
    weight[7] = weight[7].abs() + 0.01  # no negative value: min widened to 0
    scale, offset = mse_minmax_qparams(weight, bits, symmetric, group, options)
    ref_scale, ref_offset = brute_force_mse(
        weight, bits, symmetric, group, options.grid, options.maxshrink, options.norm
    )
    groups = 1 if group is None else 64 // group
    assert scale.shape == offset.shape == (24, groups) and scale.dtype == torch.float32
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(offset.double(), ref_offset)
    # A search that includes p = 1 is never worse than plain min/max, row by row / group by group.
    plain_scale, plain_offset = minmax_qparams(weight, bits, symmetric, group)
    mse_err = weight_error(weight, scale, offset, bits, group, options.norm)
    plain_err = weight_error(weight, plain_scale, plain_offset, bits, group, options.norm)
    assert bool((mse_err <= plain_err * (1 + 1e-6)).all())
    # Where nothing better exists, plain min/max is kept bit for bit.
    kept = scale == plain_scale
    assert torch.equal(offset[kept], plain_offset[kept])
    assert bool(kept[5].all())


@pytest.mark.parametrize(
    ("bits", "symmetric", "group"),
    [(4, True, None), (4, False, None), (3, True, None), (3, False, None), (3, True, 64)],
)
def test_strictly_better_where_outliers_stretch_the_range(
    bits: int, symmetric: bool, group: int | None
) -> None:
    weight, mask = with_outliers(random_weight(24, 256, seed=1000), group or 256, seed=1000)
    scale, offset = mse_minmax_qparams(weight, bits, symmetric, group, MSEOptions())
    plain_scale, plain_offset = minmax_qparams(weight, bits, symmetric, group)
    ratio = weight_error(weight, scale, offset, bits, group) / weight_error(
        weight, plain_scale, plain_offset, bits, group
    )
    assert bool((ratio[mask] < 1).all()), ratio[mask]
    assert bool((ratio <= 1 + 1e-6).all())
    # the chosen ranges are shrunk (never widened), by at most maxshrink
    shrink = scale / plain_scale
    assert bool((shrink <= 1).all()) and bool((shrink >= 0.8 * (1 - 1e-6)).all())


def test_vectorised_over_any_dim_dtype_and_deterministic() -> None:
    weight, _ = with_outliers(random_weight(16, 96, seed=3), 32, seed=3)
    rows = mse_qparams(weight, 4, False)
    cols = mse_qparams(weight.t().contiguous(), 4, False, dim=0)
    assert torch.equal(rows[0], cols[0]) and torch.equal(rows[1], cols[1])
    grouped = mse_qparams(weight.reshape(16, 3, 32), 4, True)  # per group of 32
    expected = mse_minmax_qparams(weight, 4, True, 32, MSEOptions())
    assert torch.equal(grouped[0], expected[0])
    again = mse_minmax_qparams(weight, 4, True, 32, MSEOptions())
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])
    half = weight.bfloat16()
    from_half = mse_qparams(half, 4, True)
    from_float = mse_qparams(half.float(), 4, True)
    assert from_half[0].dtype == torch.float32 and torch.equal(from_half[0], from_float[0])
    parameter = torch.nn.Parameter(weight)  # a module's weight outside no_grad works too
    assert torch.equal(mse_qparams(parameter, 4, True)[0], mse_qparams(weight, 4, True)[0])


def test_options_are_checked_and_off_by_default() -> None:
    assert MinMaxExt().mse is False and GPTQExt(numerics="msmodelslim").resolved_mse(4) is False
    assert GPTQ_EXT_DEFAULTS["mse"] is False
    on = MinMaxExt(mse=True)
    assert (on.mse_grid, on.mse_maxshrink, on.mse_norm) == (100, 0.2, 2.4)
    for bad in [dict(grid=0), dict(maxshrink=1.0), dict(maxshrink=0.0), dict(norm=-1.0)]:
        with pytest.raises(ValueError, match="invalid MSE clipping options"):
            MSEOptions(**bad)  # type: ignore[arg-type]
    # a grid that only holds p = 1 reproduces plain min/max bit for bit
    weight = random_weight(8, 64, seed=4)
    plain = quantize_weight_minmax(weight, 4, False, 16)
    one = quantize_weight_minmax(weight, 4, False, 16, mse=MSEOptions(grid=4, maxshrink=0.2))
    assert torch.equal(one.scale, plain.scale) and torch.equal(one.codes, plain.codes)


# -- round-to-nearest and GPTQ ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bits", "symmetric", "group"),
    [(4, True, None), (4, True, 32), (4, False, None), (8, True, 32)],
)
def test_rtn_output_error_not_above_plain(bits: int, symmetric: bool, group: int | None) -> None:
    weight, calib, held = synthetic_layer()
    plain = quantize_weight_minmax(weight, bits, symmetric, group)
    clipped = quantize_weight_minmax(weight, bits, symmetric, group, mse=MSEOptions())
    expected = mse_minmax_qparams(weight, bits, symmetric, group, MSEOptions())
    assert torch.equal(clipped.scale, expected[0]) and torch.equal(clipped.offset, expected[1])
    assert torch.equal(clipped.codes, quantize(weight, *expected, bits, group))
    for x in (calib, held):
        assert output_error(x, weight, clipped.dequantize()) <= output_error(
            x, weight, plain.dequantize()
        )


GPTQ_VARIANTS = {
    "per-channel": (None, {}),
    "act-order": (None, {"desc_act": True}),
    "dynamic-groups": (32, {}),
    "static-groups": (32, {"static_groups": True}),
    "act-order-groups": (32, {"desc_act": True}),
}


def _gptq(
    bits: int, symmetric: bool, variant: str, mse: bool
) -> WeightPerChannelGPTQ | WeightPerGroupGPTQ:
    group, options = GPTQ_VARIANTS[variant]
    if group is None:
        return WeightPerChannelGPTQ(bits, symmetric, block_size=32, mse=mse, **options)
    return WeightPerGroupGPTQ(bits, symmetric, group_size=group, block_size=32, mse=mse, **options)


@pytest.mark.parametrize("variant", list(GPTQ_VARIANTS))
@pytest.mark.parametrize(("bits", "symmetric"), [(4, True), (8, True), (4, False)])
def test_gptq_with_mse(bits: int, symmetric: bool, variant: str) -> None:
    weight, calib, held = synthetic_layer()
    results = {}
    for mse in (False, True):
        quantizer = _gptq(bits, symmetric, variant, mse)
        quantizer.add_batch(calib)
        results[mse] = quantizer.quantize(weight)
    plain, clipped = results[False], results[True]
    q = clipped.quantized
    qmin, qmax = qrange(bits)
    assert int(q.codes.min()) >= qmin and int(q.codes.max()) <= qmax
    assert torch.equal(quantize(q.dequantize(), q.scale, q.offset, bits, q.group_size), q.codes)
    assert not torch.equal(q.scale, plain.quantized.scale)  # the search moved some scales
    group, options = GPTQ_VARIANTS[variant]
    # Parameters fixed before the sweep come from the search on the original weight; dynamic
    # groups search the running weight, which is the original one for the first group only.
    searched = mse_minmax_qparams(weight, bits, symmetric, group, MSEOptions())
    if group is None or options:
        assert torch.equal(q.scale, searched[0]) and torch.equal(q.offset, searched[1])
    else:
        assert torch.equal(q.scale[:, 0], searched[0][:, 0])
        assert not torch.equal(q.scale[:, 1:], searched[0][:, 1:])
    ratio = output_error(held, weight, clipped.dequantized()) / output_error(
        held, weight, plain.dequantized()
    )
    if symmetric:
        assert ratio <= 1.02, f"held-out error with mse / without: {ratio:.4f}"
    if bits == 4 and symmetric:
        assert ratio < 0.98, f"held-out error with mse / without: {ratio:.4f}"


def test_gptq_options_from_ext_and_errors() -> None:
    ext = {"mse": True, "mse_grid": 50, "mse_maxshrink": 0.3, "mse_norm": 2.0, "group_size": 64}
    per_group = WeightPerGroupGPTQ.from_ext(4, True, ext, name="q_proj")
    assert per_group.options.mse == MSEOptions(50, 0.3, 2.0)
    assert "mse=MSEOptions(grid=50" in repr(per_group)
    per_channel = WeightPerChannelGPTQ.from_ext(8, True, {"mse": True, "group_size": 128})
    assert per_channel.options.mse == MSEOptions()
    assert WeightPerChannelGPTQ.from_ext(8, True, {"mse": None}).options.mse is None
    with pytest.raises(QuantizationError, match=r"o_proj: invalid GPTQ options: .*mse_grid.*0"):
        WeightPerChannelGPTQ(mse=True, mse_grid=0, name="o_proj")
    with pytest.raises(QuantizationError, match=r"mse_maxshrink must be a number in \(0, 1\)"):
        WeightPerGroupGPTQ(mse_maxshrink=1.5)
    with pytest.raises(QuantizationError, match=r"mse_norm must be a finite number > 0"):
        WeightPerGroupGPTQ(mse_norm=float("nan"))
    with pytest.raises(QuantizationError, match=r"mse must be a bool"):
        WeightPerChannelGPTQ(mse="yes")  # type: ignore[arg-type]
    with pytest.raises(QuantizationError, match=r"unknown GPTQ ext option\(s\) \['mse_steps'\]"):
        WeightPerChannelGPTQ.from_ext(8, True, {"mse_steps": 10})


# -- YAML ---------------------------------------------------------------------------------------


def _linear_quant(weight: str) -> str:
    return f"spec:\n  process:\n    - type: linear_quant\n      qconfig: {{weight: {weight}}}\n"


@pytest.mark.parametrize("method", ["minmax", "gptq"])
def test_yaml_accepts_mse(method: str) -> None:
    registry = msquant.plugin.default_registry()
    text = _linear_quant(f"{{method: {method}, scope: per_group, ext: {{mse: true}}}}")
    weight = msquant.load_config_text(text, registry).spec.process[0].qconfig.weight
    ext = weight.ext
    assert isinstance(ext, MinMaxExt | GPTQExt) and ext.model_fields_set == {"mse"}
    assert ext.mse is True and (ext.mse_grid, ext.mse_maxshrink, ext.mse_norm) == (100, 0.2, 2.4)
    text = _linear_quant(
        f"{{method: {method}, ext: {{mse: true, mse_grid: 40, mse_maxshrink: 0.5, mse_norm: 2}}}}"
    )
    ext = msquant.load_config_text(text, registry).spec.process[0].qconfig.weight.ext
    assert isinstance(ext, MinMaxExt | GPTQExt) and ext.mse is True
    assert (ext.mse_grid, ext.mse_maxshrink, ext.mse_norm) == (40, 0.5, 2.0)


@pytest.mark.parametrize("method", ["minmax", "gptq"])
@pytest.mark.parametrize(
    ("ext", "key", "message"),
    [
        ("{mse: maybe}", "mse", "boolean"),
        ("{mse: true, mse_grid: 0}", "mse_grid", "greater than 0"),
        ("{mse: true, mse_grid: 1001}", "mse_grid", "less than or equal to 1000"),
        ("{mse_grid: 2.5}", "mse_grid", "integer"),
        ("{mse_maxshrink: 1.0}", "mse_maxshrink", "less than 1"),
        ("{mse_maxshrink: 0}", "mse_maxshrink", "greater than 0"),
        ("{mse_norm: -2}", "mse_norm", "greater than 0"),
        ("{mse_norm: .inf}", "mse_norm", "finite"),
        ("{mse_steps: 3}", "mse_steps", "mse_grid"),
    ],
)
def test_yaml_rejects_bad_mse_values_with_paths(
    method: str, ext: str, key: str, message: str
) -> None:
    text = _linear_quant(f"{{method: {method}, ext: {ext}}}")
    with pytest.raises(msquant.ConfigError) as info:
        msquant.load_config_text(text, msquant.plugin.default_registry())
    issues = [issue for issue in info.value.issues if issue.path == f"{W}.ext.{key}"]
    assert len(issues) == 1, [str(issue) for issue in info.value.issues]
    assert message in issues[0].message


# -- end to end ---------------------------------------------------------------------------------


def _config(method: str, scope: str, symmetric: bool, ext: dict[str, object]) -> dict[str, object]:
    weight = {"scope": scope, "dtype": "int8", "symmetric": symmetric, "method": method, "ext": ext}
    return {"spec": {"process": [{"type": "linear_quant", "qconfig": {"weight": weight}}]}}


def test_end_to_end_gptq_and_minmax_with_mse(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    original = load_causal_lm(model_dir).state_dict()
    exports = {}
    for name, config in {
        "gptq": _config("gptq", "per_channel", True, {}),
        "gptq_mse": _config("gptq", "per_channel", True, {"mse": True}),
        "minmax_mse": _config("minmax", "per_group", True, {"group_size": 64, "mse": True}),
    }.items():
        msquant.quantize(
            model_dir, tmp_path / name, config, progress=False, calib_path=CALIB_TXT,
            max_calib_tokens=16,
        )  # fmt: skip
        exports[name] = read_ascend_export(tmp_path / name)
    modules = exports["gptq_mse"].quantized_modules()
    assert modules and sorted(modules) == sorted(exports["gptq"].quantized_modules())
    changed, changed_rtn = 0, 0
    for module in modules:
        weight = original[f"{module}.weight"]
        plain = exports["gptq"].tensors[f"{module}.weight_scale"]
        scale = exports["gptq_mse"].tensors[f"{module}.weight_scale"]
        changed += int((scale != plain).sum())
        # Per-channel: the search shrinks each row's range by p = 1 - i/100, i <= 20.
        steps = (1 - scale / plain) * 100
        assert bool((steps - steps.round()).abs().max() < 1e-3) and bool(
            (steps.round() <= 20).all()
        )
        # The dequantized weight lies within the clipped range [-128 s, 127 s] ...
        fake = exports["gptq_mse"].dequantized(module)
        assert bool((fake <= 127 * scale * (1 + 1e-6)).all())
        assert bool((fake >= -128 * scale * (1 + 1e-6)).all())
        # ... which lies within the observed range and covers at least 80% of it.
        peak = weight.abs().amax(dim=1, keepdim=True)
        assert bool((127 * scale <= peak * (1 + 1e-6)).all())
        assert bool((127 * scale >= 0.8 * peak * (1 - 1e-6)).all())
        # minmax with mse: the exported parameters and codes are those of the search.
        export = exports["minmax_mse"]
        expected = mse_minmax_qparams(weight, 8, True, 64, MSEOptions())
        assert torch.equal(export.tensors[f"{module}.weight_scale"], expected[0])
        assert torch.equal(export.tensors[f"{module}.weight_offset"], expected[1])
        assert torch.equal(export.tensors[f"{module}.weight"], quantize(weight, *expected, 8, 64))
        changed_rtn += int((expected[0] != minmax_qparams(weight, 8, True, 64)[0]).sum())
    assert changed > 0 and changed_rtn > 0, "the MSE search changed no scale on the tiny model"
