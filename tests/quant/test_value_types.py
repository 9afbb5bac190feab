"""The quantized-value contract (:mod:`msquant.quant.value_types`): integer codes unchanged, MX
codes decoded through their element table, the names schemes, activations and checkpoints use."""

from __future__ import annotations

import pytest
import torch

from msquant.plugin import ActivationQuant, QDType, QuantizedWeight, ResolvedScheme
from msquant.plugin.numerics import value_type_named
from msquant.quant.int_quant import dequantize, minmax_qparams, quantize
from msquant.quant.minifloat import E4M3
from msquant.quant.mx_quant import mx_dequantize, mx_quantize
from msquant.quant.value_types import VALUE_TYPES, IntValues, MXValues


def test_integer_weights_dequantize_as_before() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 64)
    scale, offset = minmax_qparams(weight, 4, False, 16)
    codes = quantize(weight, scale, offset, 4, 16)
    qweight = QuantizedWeight(codes, scale, offset, 4, False, 16)
    assert qweight.value_type == IntValues(4) and qweight.value_type.name == "int4"
    assert torch.equal(qweight.dequantize(), dequantize(codes, scale, offset, 16))


def test_mx_weight_codes_scales_and_dequantize() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 96)
    values = value_type_named("mxfp8")
    qweight = QuantizedWeight.self_scaled(weight, values)
    assert isinstance(values, MXValues) and qweight.value_type is values
    assert qweight.codes.dtype == torch.uint8 and qweight.scale.shape == (4, 3)
    assert (qweight.bits, qweight.group_size, qweight.symmetric) == (8, 32, True)
    assert not bool(qweight.offset.any())
    elements, exponents = mx_quantize(weight, E4M3)
    assert torch.equal(qweight.scale, torch.pow(2.0, exponents))
    assert torch.equal(qweight.codes.view(torch.float8_e4m3fn).float(), elements)
    assert torch.equal(qweight.dequantize(), mx_dequantize(elements, exponents))


def test_mx_weights_refuse_partial_blocks_and_overflow() -> None:
    with pytest.raises(ValueError, match="in_features 40 is not a multiple"):
        value_type_named("mxfp4").quantize(torch.randn(2, 40))
    weight = torch.randn(2, 32)
    weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="exponent overflows"):
        value_type_named("mxfp8").quantize(weight)


def test_code_dtype_is_the_value_types() -> None:
    with pytest.raises(ValueError, match="2-D uint8 tensor, got torch.int8"):
        QuantizedWeight(
            torch.zeros(2, 32, dtype=torch.int8),
            torch.ones(2, 1),
            torch.zeros(2, 1),
            8,
            True,
            32,
            value_type_named("mxfp8"),
        )


def test_code_problems() -> None:
    assert IntValues(4).code_problems(torch.tensor([-8, 7, 8])) == [
        "1 code(s) outside the 4-bit range"
    ]
    mxfp4, mxfp8 = value_type_named("mxfp4"), value_type_named("mxfp8")
    assert mxfp4.code_problems(torch.tensor([0, 15, 16], dtype=torch.uint8)) == [
        "1 code(s) wider than 4 bits"
    ]
    assert mxfp8.code_problems(torch.tensor([0x7F, 0xFF, 1], dtype=torch.uint8)) == [
        "2 NaN e4m3 code(s)"
    ]


def test_qdtype_names_its_value_type() -> None:
    assert (QDType.MXFP8.bits, QDType.MXFP4.bits, QDType.INT8.bits, QDType.INT4.bits) == (
        8,
        4,
        8,
        4,
    )
    assert QDType.MXFP4.value_type is VALUE_TYPES["mxfp4"]
    assert QDType.FP8_E4M3.value_type is VALUE_TYPES["fp8_e4m3"] and QDType.FP8_E4M3.bits == 8
    with pytest.raises(ValueError, match="has no quantized value type"):
        _ = QDType.FLOAT.bits
    with pytest.raises(ValueError, match="unknown quantized value type 'fp6'; known: int2"):
        value_type_named("fp6")


def test_schemes_describe_their_value_type() -> None:
    mx = ResolvedScheme(4, 32, True, False, None, 0.0, False, False, "qconfig", value_type="mxfp4")
    plain = ResolvedScheme(4, 32, True, False, None, 0.0, False, False, "qconfig")
    assert mx.describe() == "mxfp4 block 32" and plain.describe() == "int4 group 32 sym"
    assert mx.signature() != plain.signature()
    assert value_type_named("mxfp8").error_bound() == 0.125
    assert value_type_named("int8").error_bound() == 2.0**-5


def test_per_block_activations() -> None:
    act = ActivationQuant("per_block", value_type="mxfp4")
    assert (act.bits, act.dynamic, act.describe()) == (4, True, "a mxfp4 per_block")
    assert act.scheme_name(4) == "W4A4_MXFP4"
    assert ActivationQuant("per_block", value_type="mxfp8").scheme_name(8) == "W8A8_MXFP8"
    assert ActivationQuant("per_block", value_type="mxfp8").scheme_name(4) == "W4A8_MXFP"
    assert ActivationQuant.from_json(act.to_json()) == act
    assert "value_type" not in ActivationQuant("per_token").to_json()  # int records unchanged
    with pytest.raises(ValueError, match="block value type, got int8"):
        ActivationQuant("per_block", value_type="int8")
    with pytest.raises(ValueError, match="per_token activations are int8, not mxfp8"):
        ActivationQuant("per_token", value_type="mxfp8")


# --- FP8 (fp8_e4m3) ------------------------------------------------------------------------------


def _e4m3_nearest_even(v: torch.Tensor) -> torch.Tensor:
    """float64 reference of torch's float8_e4m3fn cast of values within +-448: the nearest point
    of the e4m3 grid, ties to the even code (even mantissa)."""
    grid = E4M3.decode(torch.arange(256)).double()
    finite = torch.isfinite(grid)
    points, codes = grid[finite], torch.arange(256)[finite]
    distance = (v.double().unsqueeze(-1) - points).abs()
    ties = distance == distance.min(dim=-1, keepdim=True).values
    even = ties & (codes % 2 == 0)
    pick = torch.where(even.any(dim=-1, keepdim=True), even, ties)
    return (points * pick).sum(-1) / pick.sum(-1)


def test_fp8_weights_are_msmodelslims_rule_against_a_float64_reference() -> None:
    values = VALUE_TYPES["fp8_e4m3"]
    torch.manual_seed(0)
    weight = torch.randn(16, 64) * torch.logspace(-3, 2, 16).unsqueeze(1)
    weight[3] = 0.0  # an all-zero channel: amax floored at 1e-12, elements 0
    weight[5, 7] = -weight[5].abs().max() * 1.0  # the channel's max is negative
    codes, scale, offset = values.quantize(weight)
    assert codes.dtype == torch.uint8 and scale.shape == (16, 1) and not offset.any()
    want_scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
    assert torch.equal(scale, want_scale)
    scaled = (weight / want_scale).clamp(-448, 448)
    assert torch.equal(values.decode(codes).double(), _e4m3_nearest_even(scaled))
    assert float(values.decode(codes).abs().amax(dim=1).max()) == 448.0  # amax maps to 448
    assert not values.decode(codes)[3].any()
    assert values.code_problems(codes) == []
    assert values.code_problems(torch.tensor([0x7F, 0xFF, 1], dtype=torch.uint8)) == [
        "2 NaN float8_e4m3fn code(s)"
    ]


def test_fp8_rounding_ties_go_to_even_and_saturate() -> None:
    # 17 lies halfway between e4m3's 16 and 18: the even mantissa (16) wins; 19 -> 20 likewise
    values = VALUE_TYPES["fp8_e4m3"]
    codes, scale, _ = values.quantize(torch.tensor([[448.0, 17.0, 19.0, -17.0, 0.0]]))
    assert float(scale) == 1.0
    assert values.decode(codes).tolist() == [[448.0, 16.0, 20.0, -16.0, 0.0]]


def test_fp8_dynamic_activations_scale_each_token() -> None:
    values = VALUE_TYPES["fp8_e4m3"]
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64, dtype=torch.float64).float()
    x[0, 1] *= 1000  # one loud token does not coarsen the others
    fake = values.fake_quantize(x)
    rows = x.reshape(-1, 64)
    scale = rows.abs().amax(dim=1, keepdim=True) / 448
    want = _e4m3_nearest_even((rows / scale).clamp(-448, 448)) * scale.double()
    assert torch.allclose(fake.reshape(-1, 64).double(), want, rtol=1e-6, atol=1e-12)
    relative = ((fake - x).norm() / x.norm()).item()
    assert 0 < relative < 2.0**-4
