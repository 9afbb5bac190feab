"""Round-to-nearest numerics against an independent float64 reference of msModelSlim's formulas."""

from __future__ import annotations

import pytest
import torch

from msquant import QuantizationError
from msquant.plugin import QuantizedWeight
from msquant.plugin.numerics import compute_qparams, qrange, quantize_weight_minmax


def reference_minmax(
    w: torch.Tensor, bits: int, symmetric: bool, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Element-by-element float64 re-derivation: (codes, scale, offset) for each row/group."""
    w = w.double()
    out_f, in_f = w.shape
    g = in_f if group_size is None else group_size
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    eps = float(torch.finfo(torch.float32).eps)
    codes = torch.empty(out_f, in_f, dtype=torch.int64)
    scale = torch.empty(out_f, in_f // g, dtype=torch.float64)
    offset = torch.empty_like(scale)
    for r in range(out_f):
        for k in range(in_f // g):
            chunk = w[r, k * g : (k + 1) * g]
            lo, hi = min(float(chunk.min()), 0.0), max(float(chunk.max()), 0.0)
            if symmetric:
                s, o = max(max(-lo, hi) / qmax, eps), 0.0
            else:
                s = max(hi / (2**bits - 1) - lo / (2**bits - 1), eps)
                o = float(round(-lo / s)) + qmin
            scale[r, k], offset[r, k] = s, o
            codes[r, k * g : (k + 1) * g] = torch.clamp(
                torch.round(chunk / s + o), qmin, qmax
            ).long()
    return codes, scale, offset


CASES = [
    pytest.param(True, None, id="per-channel-sym"),
    pytest.param(False, None, id="per-channel-asym"),
    pytest.param(True, 16, id="per-group-sym"),
    pytest.param(False, 16, id="per-group-asym"),
]


@pytest.mark.parametrize(("symmetric", "group_size"), CASES)
def test_minmax_matches_float64_reference(symmetric: bool, group_size: int | None) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 64) * torch.linspace(0.01, 3.0, 24)[:, None]
    w[3] = w[3].abs() + 0.5  # a row without negative values: min widened to 0
    w[5] = -w[5].abs() - 0.5  # a row without positive values: max widened to 0
    w[7] = 0.0  # an all-zero row: scale floored at eps
    q = quantize_weight_minmax(w, 8, symmetric, group_size)
    ref_codes, ref_scale, ref_offset = reference_minmax(w, 8, symmetric, group_size)
    torch.testing.assert_close(q.scale.double(), ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.offset.double(), ref_offset)
    mismatch = (q.codes.long() != ref_codes).sum().item()
    assert mismatch <= 2, f"{mismatch} codes differ from the float64 reference"  # ties only
    assert int(q.codes.min()) >= -128 and int(q.codes.max()) <= 127
    # dequantized values are within half a step of the original (float64 check)
    err = (q.dequantize().double() - w.double()).abs()
    step = ref_scale.repeat_interleave(64 if group_size is None else group_size, dim=1)
    assert bool((err <= step / 2 + 1e-6).all())


def test_symmetric_offsets_zero_and_asym_offsets_signed_integral() -> None:
    torch.manual_seed(1)
    w = torch.randn(8, 32) + 0.3
    sym = quantize_weight_minmax(w, 8, True, None)
    asym = quantize_weight_minmax(w, 8, False, 8)
    assert torch.count_nonzero(sym.offset) == 0
    assert int(sym.codes.abs().max()) == 127  # the largest magnitude maps to +-127 exactly
    assert torch.equal(asym.offset, asym.offset.round())
    assert float(asym.offset.min()) >= -128 and float(asym.offset.max()) <= 127
    assert tuple(asym.scale.shape) == (8, 4) and tuple(sym.scale.shape) == (8, 1)


def test_asymmetric_uses_full_code_range() -> None:
    w = torch.tensor([[-1.0, 0.0, 3.0, 2.0]])
    q = quantize_weight_minmax(w, 8, False, None)
    assert int(q.codes.min()) == -128 and int(q.codes.max()) == 127
    assert q.dequantize()[0, 1].item() == 0.0  # zero is exactly representable


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_are_solved_in_float32(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    w32 = torch.randn(16, 32)
    w = w32.to(dtype)
    q = quantize_weight_minmax(w, 8, False, 16)
    q_ref = quantize_weight_minmax(w.float(), 8, False, 16)
    assert q.scale.dtype == torch.float32
    assert torch.equal(q.codes, q_ref.codes) and torch.equal(q.scale, q_ref.scale)


def test_qparams_bits_and_range() -> None:
    assert qrange(8) == (-128, 127) and qrange(4) == (-8, 7)
    scale, offset = compute_qparams(torch.tensor([-2.0]), torch.tensor([1.0]), 4, True)
    assert scale.item() == pytest.approx(2.0 / 7) and offset.item() == 0
    with pytest.raises(ValueError, match="between 2 and 8"):
        qrange(9)


@pytest.mark.parametrize(
    ("weight", "group_size", "match"),
    [
        (torch.randn(4, 4, 4), None, "must be 2-D"),
        (torch.ones(4, 8, dtype=torch.int32), None, "floating point"),
        (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), None, "1 NaN/Inf"),
        (torch.tensor([[1.0, float("inf")], [0.0, 1.0]]), None, "NaN/Inf"),
        (
            torch.randn(4, 96),
            64,
            r"group_size 64 does not divide in_features 96 .*valid group sizes: 1, 2, 3",
        ),
    ],
)
def test_bad_weights_are_rejected_with_the_layer_name(
    weight: torch.Tensor, group_size: int | None, match: str
) -> None:
    with pytest.raises(QuantizationError, match=match) as info:
        quantize_weight_minmax(weight, 8, True, group_size, name="model.layers.0.mlp.up_proj")
    assert "model.layers.0.mlp.up_proj" in str(info.value)


def test_quantized_weight_validates_its_shapes() -> None:
    codes = torch.zeros(4, 8, dtype=torch.int8)
    good = torch.ones(4, 2)
    QuantizedWeight(codes, good, torch.zeros(4, 2), 8, True, 4)
    with pytest.raises(ValueError, match="scale must be float32"):
        QuantizedWeight(codes, torch.ones(4, 1), torch.zeros(4, 1), 8, True, 4)
    with pytest.raises(ValueError, match="2-D int8"):
        QuantizedWeight(codes.int(), good, good, 8, True, 4)
