"""MX numerics (:mod:`msquant.quant.minifloat`, :mod:`msquant.quant.mx_quant`): every e2m1 and
e4m3 code decoded, encode round trips, msModelSlim's rules against a float64 scalar re-derivation,
tie rounding, saturation, zero and non-finite blocks, padding, dtypes.

That the rules are msModelSlim 26.1.0's own is established by the opt-in oracle
(``tests/oracle/test_msmodelslim_mx.py``: exports bit-identical on a tiny Qwen3).
"""

from __future__ import annotations

import math

import pytest
import torch

from msquant.quant.minifloat import E2M1, E4M3, pack_nibbles, unpack_nibbles
from msquant.quant.mx_quant import (
    BLOCK_SIZE,
    mx_dequantize,
    mx_exponents,
    mx_fake_quantize,
    mx_quantize,
)

#: msModelSlim's rule of each element format (MXFP8: e4m3, MXFP4: e2m1).
RULES = {"e4m3": "mxfp8", "e2m1": "mxfp4"}
#: OCP FP4 E2M1: the value of each code (sign in bit 3).
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# --- element formats --------------------------------------------------------------------------


def test_every_e2m1_code_decodes_to_the_ocp_table() -> None:
    values = E2M1.decode(torch.arange(16))
    assert values[:8].tolist() == E2M1_VALUES
    assert values[8:].tolist() == [-v for v in E2M1_VALUES]
    assert torch.signbit(values[8])  # code 0x8 is -0.0
    assert E2M1.max_value == 6.0 and E2M1.bits == 4


def test_every_e4m3_code_decodes_as_torch_float8_e4m3fn() -> None:
    codes = torch.arange(256)
    ours = E4M3.decode(codes)
    theirs = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    nan = torch.isnan(theirs)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan], theirs[~nan])
    assert torch.equal(torch.signbit(ours[~nan]), torch.signbit(theirs[~nan]))
    assert E4M3.max_value == 448.0
    assert float(ours[1]) == 2.0**-9  # smallest subnormal


@pytest.mark.parametrize("element", [E2M1, E4M3], ids=lambda e: e.name)
def test_every_finite_code_encodes_back_to_itself(element) -> None:  # type: ignore[no-untyped-def]
    codes = torch.tensor([c for c in range(1 << element.bits) if c not in element.nan_codes])
    assert torch.equal(element.encode(element.decode(codes)), codes.to(torch.uint8))


def test_encode_refuses_values_outside_the_format() -> None:
    with pytest.raises(ValueError, match=r"\[0.75\] are not e2m1 values"):
        E2M1.encode(torch.tensor([1.0, 0.75]))
    with pytest.raises(ValueError, match="not e4m3 values"):
        E4M3.encode(torch.tensor([449.0]))


def test_nibbles_pack_low_first_and_unpack() -> None:
    codes = torch.tensor([[1, 2, 15, 8], [0, 7, 9, 3]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x8F], [0x70, 0x39]]
    assert torch.equal(unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="even last dimension"):
        pack_nibbles(codes[:, :3])


# --- float64 re-derivation of msModelSlim's rules ----------------------------------------------


def _floor_log2(value: float) -> int:
    """Exact ``floor(log2(value))`` of a positive float (frexp, not a rounded log2)."""
    return math.frexp(value)[1] - 1


def _round_away(value: float) -> float:
    return math.copysign(math.floor(abs(value) + 0.5), value)


def reference_block(block: list[float], element: str) -> tuple[int, list[float]]:
    """One block's shared exponent and element values, scalar float64 (module docstring of
    :mod:`msquant.quant.mx_quant`)."""
    amax = max(abs(v) for v in block)
    if element == "e4m3":
        exponent = (_floor_log2(amax) if amax > 0 else -126) - 8
        exponent = max(exponent, -127)
        elements = []
        for x in block:
            v = x / 2.0**exponent
            if v == 0:
                elements.append(0.0)
                continue
            p = max(_floor_log2(abs(v)), -6)
            q = _round_away(v / 2.0**p * 8) / 8 * 2.0**p
            elements.append(min(max(q, -448.0), 448.0))
        return exponent, elements
    exponent = math.floor(math.log2(amax / 0.875 + 9.6e-7)) - 2
    exponent = min(max(exponent, -129), 125)
    elements = []
    for x in block:
        v = abs(x) / 2.0**exponent
        p = min(max(math.floor(math.log2(v + 9.6e-7)), 0), 2)
        q = min(math.floor(v / 2.0**p * 2 + 0.5) / 2 * 2.0**p, 6.0)
        elements.append(math.copysign(q, x) if x != 0 else 0.0)
    return exponent, elements


@pytest.mark.parametrize("element", [E4M3, E2M1], ids=lambda e: e.name)
@pytest.mark.parametrize("magnitude", [1e-3, 0.05, 1.0, 300.0])
def test_quantize_matches_the_float64_reference(element, magnitude: float) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    weight = torch.randn(6, 4 * BLOCK_SIZE) * magnitude
    weight[1, :BLOCK_SIZE] = 0.0  # an all-zero block
    weight[2, 3] *= 50  # an outlier block
    elements, exponents = mx_quantize(weight, element, RULES[element.name])
    assert elements.dtype == torch.float32 and exponents.dtype == torch.float32
    assert elements.shape == weight.shape and exponents.shape == (6, 4)
    for row in range(6):
        for block in range(4):
            values = weight[row, block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE].tolist()
            exponent, expected = reference_block(values, element.name)
            got = elements[row, block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE].tolist()
            assert int(exponents[row, block]) == exponent, (row, block)
            assert got == expected, (row, block)
    # the element values are values of the format, the dequantized weight element * 2^e
    element.encode(elements)
    expected_weight = elements.double() * torch.pow(2.0, exponents.double()).repeat_interleave(
        BLOCK_SIZE, dim=1
    )
    assert torch.equal(mx_dequantize(elements, exponents).double(), expected_weight)


def test_zero_blocks_take_the_floor_exponent() -> None:
    zeros = torch.zeros(1, BLOCK_SIZE)
    assert mx_exponents(zeros.abs().amax(-1), E4M3).tolist() == [-127.0]  # 2^-126 -> -134 -> -127
    assert mx_exponents(zeros.abs().amax(-1), E2M1, "mxfp4").tolist() == [
        -22.0
    ]  # log2(9.6e-7) -> -20
    for element in (E4M3, E2M1):
        elements, _ = mx_quantize(zeros, element, RULES[element.name])
        assert not bool(elements.any())


def test_e4m3_ties_round_half_away_from_zero_unlike_the_float8_cast() -> None:
    # amax 256 -> e = 8 - 8 = 0; at 2^8 the e4m3 step is 32: 272 is a tie between 256 and 288
    block = torch.zeros(1, BLOCK_SIZE)
    block[0, :5] = torch.tensor([256.0, 272.0, -272.0, 1.0625, 2.0**-10 * 3])
    elements, exponents = mx_quantize(block, E4M3)
    assert exponents.tolist() == [[0.0]]
    assert elements[0, :5].tolist() == [256.0, 288.0, -288.0, 1.125, 2.0**-9 * 2]
    # torch's cast (OCP) rounds half to even: msModelSlim's rounding is not a float8 cast
    assert block[0, 1].to(torch.float8_e4m3fn).float() == 256.0


def test_e2m1_ties_round_half_away_from_zero() -> None:
    # amax 6 -> e = floor(log2(6 / 0.875)) - 2 = 0
    block = torch.zeros(1, BLOCK_SIZE)
    block[0, :6] = torch.tensor([6.0, 2.5, 5.0, 0.25, -0.75, -1e-3])
    elements, exponents = mx_quantize(block, E2M1, "mxfp4")
    assert exponents.tolist() == [[0.0]]
    assert elements[0, :6].tolist() == [6.0, 3.0, 6.0, 0.5, -1.0, -0.0]
    assert torch.signbit(elements[0, 5])  # a negative value rounding to 0 keeps its sign
    assert E2M1.encode(elements[0, 5:6]).tolist() == [0x8]


def test_e4m3_saturates_at_448() -> None:
    # amax 500 -> e = 8 - 8 = 0; 500 rounds to 512 and 460 to 448: both clamp to 448
    block = torch.zeros(1, BLOCK_SIZE)
    block[0, :3] = torch.tensor([500.0, -460.0, 300.0])
    elements, exponents = mx_quantize(block, E4M3)
    assert exponents.tolist() == [[0.0]]
    assert elements[0, :3].tolist() == [448.0, -448.0, 288.0]


def test_e2m1_block_maximum_stays_below_7_and_rounds_to_6() -> None:
    # amax 6.9 -> e = floor(log2(7.886)) - 2 = 0: 6.9 rounds to 6 (the grid's top), never above
    block = torch.zeros(1, BLOCK_SIZE)
    block[0, 0] = 6.9
    elements, exponents = mx_quantize(block, E2M1, "mxfp4")
    assert exponents.tolist() == [[0.0]] and float(elements[0, 0]) == 6.0


def test_e4m3_exponent_of_an_infinite_block_is_nan() -> None:
    block = torch.ones(1, BLOCK_SIZE)
    block[0, 0] = float("inf")
    _, exponents = mx_quantize(block, E4M3)
    assert math.isnan(float(exponents[0, 0]))


def test_unknown_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown MX rule 'ocp'; known: mxfp8, mxfp4"):
        mx_quantize(torch.ones(1, 32), E4M3, "ocp")


def test_log2_rounding_is_msmodelslims_not_exact() -> None:
    # the float32 just below 2^10: its float32 log2 rounds to 10.0, so the block takes exponent
    # 10 - 8 and stores 256 * 2^2 = 1024, where the exact exponent 9 - 8 would saturate it at
    # 448 * 2 = 896
    below = torch.tensor([[1024.0]]).nextafter(torch.tensor(0.0))
    assert _floor_log2(float(below)) == 9
    assert mx_exponents(below, E4M3).tolist() == [[10.0 - 8]]
    elements, exponents = mx_quantize(below, E4M3)
    assert mx_dequantize(elements, exponents).tolist() == [[1024.0]]


def test_padding_and_fake_quantize_agree_with_the_padded_tensor() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 2, 40)
    padded = torch.nn.functional.pad(x, (0, 24))
    for element in (E4M3, E2M1):
        elements, exponents = mx_quantize(x, element, RULES[element.name])
        assert exponents.shape == (3, 2, 2)
        full, full_exponents = mx_quantize(padded, element, RULES[element.name])
        assert torch.equal(exponents, full_exponents)
        assert torch.equal(elements, full[..., :40])
        fake = mx_fake_quantize(x, element, RULES[element.name])
        assert torch.equal(fake, mx_dequantize(elements, exponents))


def test_fake_quantize_keeps_bfloat16_and_computes_exponents_in_it() -> None:
    torch.manual_seed(2)
    x = torch.randn(4, 64).to(torch.bfloat16)
    for element in (E4M3, E2M1):
        fake = mx_fake_quantize(x, element, RULES[element.name])
        assert fake.dtype == torch.bfloat16
        elements, exponents = mx_quantize(x, element, RULES[element.name])
        assert torch.equal(fake, mx_dequantize(elements, exponents).to(torch.bfloat16))
    # a bf16 maximum just below 2^5: its log2 rounds to 5.0 in bf16 (float32 would give 4.99...)
    amax = torch.tensor([32.0], dtype=torch.bfloat16).nextafter(
        torch.tensor([0.0], dtype=torch.bfloat16)
    )
    assert mx_exponents(amax, E4M3).tolist() == [5.0 - 8]
    assert mx_exponents(amax.float(), E4M3).tolist() == [4.0 - 8]
