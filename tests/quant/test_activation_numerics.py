"""Activation quantization numerics and the W8A8-family derived tensors, against float64
references written independently here (msquant.quant.activation, msquant.quant.w8a8_params)."""

from __future__ import annotations

import struct

import pytest
import torch

from msquant.quant.activation import (
    OnlineMinMax,
    fake_quantize_per_tensor,
    fake_quantize_per_token,
    per_tensor_qparams,
    per_token_qparams,
)
from msquant.quant.w8a8_params import (
    decode_deq_scale,
    deq_scale,
    encode_deq_scale,
    pack_int4_rows,
    quant_bias,
    scale_bias,
    unpack_int4_rows,
)

F32_REL = 2e-7  # a few float32 roundings


def ref_params(lo: float, hi: float, symmetric: bool) -> tuple[float, float]:
    """msModelSlim's int8 activation parameters in float64 (range widened to include 0)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        return max(max(-lo, hi) / 127.0, 2.0**-23), 0.0
    scale = max((hi - lo) / 255.0, 2.0**-23)
    return scale, float(round(-lo / scale) - 128)


def ref_fake_quant(x: torch.Tensor, scale: float, offset: float) -> torch.Tensor:
    x = x.double()
    return (torch.clamp(torch.round(x / scale + offset), -128, 127) - offset) * scale


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("lo", "hi"), [(-3.2, 5.1), (0.25, 4.0), (-7.0, -0.5), (-1e-3, 2e-3)])
def test_per_tensor_qparams_match_float64(lo: float, hi: float, symmetric: bool) -> None:
    scale, offset = per_tensor_qparams(lo, hi, symmetric)
    want_scale, want_offset = ref_params(lo, hi, symmetric)
    assert scale == pytest.approx(want_scale, rel=F32_REL)
    assert offset == want_offset
    assert -128 <= offset <= 127


@pytest.mark.parametrize("symmetric", [True, False])
def test_fake_quantize_per_tensor_matches_float64_and_bounds_error(symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen) * 3 + (0.0 if symmetric else 1.5)
    scale, offset = per_tensor_qparams(float(x.min()), float(x.max()), symmetric)
    got = fake_quantize_per_tensor(x, scale, offset)
    want = ref_fake_quant(x, scale, offset)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=0, atol=scale * 1e-5)
    assert float((got.double() - x.double()).abs().max()) <= scale / 2 * (1 + 1e-5)


def test_fake_quantize_per_tensor_clamps_outside_the_range() -> None:
    x = torch.tensor([-10.0, 0.0, 10.0])
    scale, offset = per_tensor_qparams(-1.0, 1.0, symmetric=True)
    got = fake_quantize_per_tensor(x, scale, offset)
    assert got.tolist() == pytest.approx([-128 * scale, 0.0, 127 * scale])


def test_per_token_fake_quant_matches_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 40, generator=gen) * torch.logspace(-2, 1, 5).reshape(1, 5, 1)
    scales = per_token_qparams(x)
    assert scales.shape == (3, 5, 1)
    want_scales = x.double().abs().amax(dim=-1, keepdim=True) / 127.0
    assert torch.allclose(scales.double(), want_scales, rtol=F32_REL, atol=0)
    got = fake_quantize_per_token(x)
    want = torch.clamp(torch.round(x.double() / want_scales), -128, 127) * want_scales
    assert torch.allclose(got.double(), want, rtol=0, atol=float(want_scales.max()) * 1e-5)
    # each token's error is at most half its own step, so small tokens keep their precision
    assert bool(((got.double() - x.double()).abs() <= want_scales / 2 * (1 + 1e-5)).all())


def test_per_token_fake_quant_keeps_dtype_and_zero_rows() -> None:
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    x[1] = torch.linspace(-1, 1, 8)
    got = fake_quantize_per_token(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got[0], x[0])


@pytest.mark.parametrize("symmetric", [True, False])
def test_online_minmax_quantizes_each_batch_with_the_range_seen_so_far(symmetric: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randn(7, 16, generator=gen) * (i + 1) + 0.3 * i for i in range(4)]
    observer = OnlineMinMax(symmetric)
    lo = hi = 0.0
    for batch in batches:
        lo, hi = min(lo, float(batch.min())), max(hi, float(batch.max()))
        scale, offset = ref_params(lo, hi, symmetric)
        got = observer.observe(batch)
        assert torch.allclose(got.double(), ref_fake_quant(batch, scale, offset), atol=scale * 1e-5)
    final_scale, final_offset = observer.qparams()
    everything = torch.cat(batches)
    want_scale, want_offset = ref_params(
        float(everything.min()), float(everything.max()), symmetric
    )
    assert final_scale == pytest.approx(want_scale, rel=F32_REL)
    assert final_offset == want_offset
    assert observer.batches == 4


def test_online_minmax_refuses_params_before_any_batch() -> None:
    with pytest.raises(ValueError, match="no activation was observed"):
        OnlineMinMax(symmetric=False).qparams()


# --- deq_scale, quant_bias, scale_bias, int4 packing --------------------------------------------


def test_deq_scale_is_the_float32_product() -> None:
    weight_scale = torch.tensor([[0.001], [0.02], [3.0]])
    got = deq_scale(0.0284, weight_scale)
    assert got.dtype == torch.float32 and got.shape == (3,)
    assert torch.allclose(got.double(), weight_scale.double().flatten() * 0.0284, rtol=F32_REL)


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32])
def test_deq_scale_int64_encoding_holds_the_float32_bits(model_dtype: torch.dtype) -> None:
    deq = torch.tensor([9.8e-6, 0.5, 1.0, 3.25e-4])
    stored = encode_deq_scale(deq, model_dtype)
    assert stored.dtype == torch.int64
    want = [struct.unpack("<i", struct.pack("<f", value))[0] for value in deq.tolist()]
    assert stored.tolist() == want
    assert torch.equal(decode_deq_scale(stored), deq)


def test_deq_scale_is_float32_for_bf16_models() -> None:
    deq = torch.tensor([0.25, 1e-5])
    stored = encode_deq_scale(deq, torch.bfloat16)
    assert stored.dtype == torch.float32 and torch.equal(stored, deq)
    assert torch.equal(decode_deq_scale(stored), deq)


def test_decode_deq_scale_refuses_values_that_are_not_float32_bits() -> None:
    with pytest.raises(ValueError, match="not float32 bits"):
        decode_deq_scale(torch.tensor([2**40], dtype=torch.int64))


def test_quant_bias_makes_the_integer_matmul_equal_the_dequantized_one() -> None:
    """W8A8 static: deq_scale * (q_w @ q_x + quant_bias) equals W' x' computed in float64."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 32, generator=gen)
    x = torch.randn(10, 32, generator=gen) + 0.7
    w_scale = weight.abs().amax(dim=1, keepdim=True) / 127
    q_w = torch.clamp(torch.round(weight / w_scale), -127, 127).to(torch.int8)
    in_scale, in_offset = per_tensor_qparams(float(x.min()), float(x.max()), symmetric=False)
    assert in_offset != 0
    q_x = torch.clamp(torch.round(x / in_scale + in_offset), -128, 127).to(torch.int64)
    bias = quant_bias(q_w, in_offset)
    assert bias.dtype == torch.int32 and bias.shape == (24,)
    integer = q_x @ q_w.to(torch.int64).T + bias.to(torch.int64)
    deq = deq_scale(in_scale, w_scale)
    got = integer.double() * deq.double()
    w_deq = q_w.double() * w_scale.double()
    x_deq = (q_x.double() - in_offset) * in_scale
    want = x_deq @ w_deq.T
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)


def test_scale_bias_matches_float64_per_chunk() -> None:
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-8, 8, (6, 32), generator=gen, dtype=torch.int8)
    weight_scale = torch.rand(6, 1, generator=gen) + 0.01
    for chunks in (1, 16):
        got = scale_bias(codes, weight_scale, chunks)
        assert got.shape == (6, chunks) and got.dtype == torch.float32
        want = 8 * weight_scale.double() * codes.double().reshape(6, chunks, -1).sum(-1)
        # float32 sums of up to 32 terms of size <= 8 * max scale: a few float32 roundings of that
        step = float(8 * weight_scale.max()) * 8 * 2**-23
        assert torch.allclose(got.double(), want, rtol=0, atol=step * 32)
    with pytest.raises(ValueError, match="must divide"):
        scale_bias(codes, weight_scale, 5)


def test_int4_rows_pack_low_nibble_first_along_the_output_dimension() -> None:
    codes = torch.tensor([[1, -8, 7], [-1, 0, -8]], dtype=torch.int8)
    packed = pack_int4_rows(codes)
    # byte = (row1 & 0xF) << 4 | (row0 & 0xF), read as signed int8
    want = [(((-1 & 0xF) << 4) | 1) - 256, ((0 << 4) | 8), (((-8 & 0xF) << 4) | 7) - 256]
    assert packed.dtype == torch.int8 and packed.tolist() == [want]
    gen = torch.Generator().manual_seed(5)
    many = torch.randint(-8, 8, (10, 12), generator=gen, dtype=torch.int8)
    assert torch.equal(unpack_int4_rows(pack_int4_rows(many)), many)


def test_int4_rows_refuse_odd_rows_and_wide_codes() -> None:
    with pytest.raises(ValueError, match="even number of rows"):
        pack_int4_rows(torch.zeros(3, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4_rows(torch.full((2, 2), 9, dtype=torch.int8))
