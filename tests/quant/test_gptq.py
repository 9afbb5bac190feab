"""GPTQ: Hessian accumulation, the solve against a float64 oracle, robustness, and every error.

The oracle (``gptq_reference.py``) is the textbook three-factorisation algorithm in float64 with
plain loops. msquant's solve (one Cholesky, Babai-form updates) must agree with it:

* run in float64 (``solve_dtype``), codes, scales, offsets and the loss agree exactly;
* run in float32 (the default), codes may differ only through rounding ties: the first
  disagreement in a row must be a code the oracle rounded from within 1e-3 of a half-integer,
  and differ by exactly 1 (later codes in that row may then follow a slightly different path);
  wherever a row's codes agree, offsets are equal and scales agree within 1e-6 relative -
  within 5e-6 for per-group parameters recomputed from the running weight (static_groups False):
  those come from a weight updated by thousands of float32 operations, and the reference run in
  float32 itself lands 1.2e-6 away from float64 on these layers (msquant: 1.4e-6 at most).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
import torch
from gptq_reference import ReferenceResult, reference_gptq

from msquant import QuantizationError
from msquant.backends.cpu import CpuBackend
from msquant.plugin.devices import DeviceSpec
from msquant.quant.gptq import (
    GPTQ_EXT_DEFAULTS,
    GPTQResult,
    WeightPerChannelGPTQ,
    WeightPerGroupGPTQ,
    gptq_quantize,
)
from msquant.quant.hessian import HessianAccumulator
from msquant.quant.int_quant import qrange, quantize
from msquant.quant.minmax import quantize_weight_minmax


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These layers are tiny: a second thread only adds stalls when the machine is busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_layer(
    out_features: int, in_features: int, rows: int, seed: int = 0, dead: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight and correlated activations (decaying spectrum, outlier channels)."""
    gen = torch.Generator().manual_seed(seed)
    decay = torch.exp(-torch.arange(in_features) / (in_features / 4))
    mixing = torch.randn(in_features, in_features, generator=gen) * decay
    x = torch.randn(rows, in_features, generator=gen) @ mixing.t()
    x += 0.1 * torch.randn(rows, in_features, generator=gen)
    x[:, :3] *= 10.0
    for column in dead:
        x[:, column] = 0.0
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    return weight, x


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    """``(2 / n) X^T X`` in float32."""
    return (2.0 / x.shape[0]) * (x.t() @ x)


def output_error(x: torch.Tensor, weight: torch.Tensor, fake: torch.Tensor) -> float:
    """``||X W^T - X Q^T|| / ||X W^T||`` in float64."""
    x, weight, fake = x.double(), weight.double(), fake.double()
    return float(torch.linalg.norm(x @ (weight - fake).t()) / torch.linalg.norm(x @ weight.t()))


def assert_matches_oracle(
    result: GPTQResult, ref: ReferenceResult, exact: bool, scale_rtol: float = 1e-6
) -> None:
    """Codes equal except rounding ties; parameters equal where the codes agree; same loss."""
    codes = result.quantized.codes.long()
    scale, offset = result.quantized.scale.double(), result.quantized.offset.double()
    mismatch = codes != ref.codes
    if exact:
        assert not bool(mismatch.any())
        assert torch.equal(scale, ref.scale) and torch.equal(offset, ref.offset)
        assert result.loss == pytest.approx(ref.loss, rel=1e-9)
        return
    assert float(mismatch.float().mean()) <= 0.01
    clean_rows = ~mismatch.any(dim=1)
    for row in torch.nonzero(~clean_rows).flatten().tolist():
        col = int(torch.nonzero(mismatch[row]).flatten()[0])
        assert abs(int(codes[row, col]) - int(ref.codes[row, col])) == 1
        fraction = float(ref.unrounded[row, col]) % 1.0
        assert abs(fraction - 0.5) < 1e-3, "a disagreement that is not a rounding tie"
    torch.testing.assert_close(scale[clean_rows], ref.scale[clean_rows], rtol=scale_rtol, atol=0)
    torch.testing.assert_close(offset[clean_rows], ref.offset[clean_rows], rtol=0, atol=0)
    # A tie resolved the other way sends the rest of that row down a slightly different path.
    assert result.loss == pytest.approx(ref.loss, rel=1e-4 if bool(clean_rows.all()) else 1e-2)


# -- the solve against the float64 oracle ----------------------------------------------------------

ORACLE_CASES = [
    (shape, block, group, symmetric, bits)
    for shape, block, group, symmetric, bits in itertools.product(
        [(16, 64), (32, 128)], [16, 32, 64, 256], [None, 16, 32], [True, False], [8, 4]
    )
] + [
    # block sizes that do not divide in_features: a shorter last block, block edges inside groups
    (shape, block, group, symmetric, 8)
    for shape, block, group, symmetric in itertools.product(
        [(16, 96)], [40, 64], [None, 16, 32], [True, False]
    )
]


@pytest.mark.parametrize(("shape", "block", "group", "symmetric", "bits"), ORACLE_CASES)
def test_solve_matches_float64_reference(
    shape: tuple[int, int], block: int, group: int | None, symmetric: bool, bits: int
) -> None:
    out_features, in_features = shape
    weight, x = make_layer(out_features, in_features, rows=4 * in_features, seed=block + bits)
    hessian = hessian_of(x)
    ref = reference_gptq(weight, hessian, bits, symmetric, group, 0.01, min(block, in_features))
    options = dict(bits=bits, symmetric=symmetric, group_size=group, block_size=block)
    exact = gptq_quantize(weight, hessian, solve_dtype=torch.float64, **options)  # type: ignore[arg-type]
    assert_matches_oracle(exact, ref, exact=True)
    fast = gptq_quantize(weight, hessian, **options)  # type: ignore[arg-type]
    assert_matches_oracle(fast, ref, exact=False, scale_rtol=1e-6 if group is None else 5e-6)
    assert fast.block_size == min(block, in_features)  # 256 is clipped to in_features


@pytest.mark.parametrize(
    ("group", "symmetric", "static"),
    [(None, True, False), (None, False, False), (16, True, True), (32, False, False)],
)
def test_act_order_matches_reference_with_trivial_g_idx(
    group: int | None, symmetric: bool, static: bool
) -> None:
    weight, x = make_layer(32, 128, rows=512, seed=7)
    hessian = hessian_of(x)
    ref = reference_gptq(weight, hessian, 4, symmetric, group, 0.01, 32, desc_act=True)
    result = gptq_quantize(
        weight, hessian, bits=4, symmetric=symmetric, group_size=group, block_size=32,
        desc_act=True, static_groups=static, solve_dtype=torch.float64,
    )  # fmt: skip
    assert_matches_oracle(result, ref, exact=True)
    assert result.perm is not None and sorted(result.perm.tolist()) == list(range(128))
    assert result.perm.tolist() != list(range(128))
    if group is None:
        assert result.g_idx is None
    else:
        assert result.static_groups  # forced by desc_act
        assert torch.equal(result.g_idx, torch.arange(128) // group)
    rtn = quantize_weight_minmax(weight, 4, symmetric, group)
    assert output_error(x, weight, result.dequantized()) <= output_error(
        x, weight, rtn.dequantize()
    )


@pytest.mark.parametrize(
    ("bits", "symmetric", "group", "desc_act"),
    [
        (bits, sym, group, act)
        for bits, sym, group, act in itertools.product(
            [8, 4], [True, False], [None, 16, 32], [False, True]
        )
    ],
)
def test_gptq_error_not_above_round_to_nearest(
    bits: int, symmetric: bool, group: int | None, desc_act: bool
) -> None:
    weight, x = make_layer(48, 128, rows=1024, seed=3)
    _, held = make_layer(48, 128, rows=1024, seed=3)
    held = held[torch.randperm(1024, generator=torch.Generator().manual_seed(5))]
    quantizer = (
        WeightPerChannelGPTQ(bits, symmetric, desc_act=desc_act, block_size=32)
        if group is None
        else WeightPerGroupGPTQ(bits, symmetric, group_size=group, desc_act=desc_act, block_size=32)
    )
    for first in range(0, 1024, 100):
        quantizer.add_batch(x[first : first + 100])
    result = quantizer.quantize(weight)
    rtn = quantize_weight_minmax(weight, bits, symmetric, group).dequantize()
    assert output_error(x, weight, result.dequantized()) <= output_error(x, weight, rtn)
    assert output_error(held, weight, result.dequantized()) <= output_error(held, weight, rtn)


@pytest.mark.parametrize(
    ("bits", "symmetric", "group"), [(8, True, None), (8, False, 32), (4, False, 16)]
)
def test_codes_ranges_shapes_and_grid(bits: int, symmetric: bool, group: int | None) -> None:
    weight, x = make_layer(24, 64, rows=256, seed=11)
    result = gptq_quantize(weight, hessian_of(x), bits=bits, symmetric=symmetric, group_size=group)
    q = result.quantized
    qmin, qmax = qrange(bits)
    assert q.codes.dtype == torch.int8 and q.codes.shape == (24, 64)
    assert int(q.codes.min()) >= qmin and int(q.codes.max()) <= qmax
    groups = 1 if group is None else 64 // group
    assert q.scale.shape == (24, groups) and q.offset.shape == (24, groups)
    assert q.scale.dtype == torch.float32 and q.offset.dtype == torch.float32
    assert bool((q.scale > 0).all())
    assert torch.equal(q.offset, torch.round(q.offset))
    if symmetric:
        assert bool((q.offset == 0).all())
    # The fake-quantized weight lies on the grid: quantizing it again gives the same codes.
    assert torch.equal(quantize(q.dequantize(), q.scale, q.offset, bits, group), q.codes)
    assert q.bits == bits and q.symmetric == symmetric and q.group_size == group
    assert result.loss > 0 and math.isfinite(result.loss)
    assert result.percdamp == 0.01 and result.damp_retries == 0
    assert result.damp == pytest.approx(0.01 * float(hessian_of(x).diagonal().mean()), rel=1e-5)


# -- robustness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, 16])
def test_dead_columns_quantize_to_zero(group: int | None) -> None:
    weight, x = make_layer(16, 64, rows=256, seed=2, dead=(0, 5, 17, 63))
    quantizer = (
        WeightPerChannelGPTQ(8, False)
        if group is None
        else WeightPerGroupGPTQ(8, False, group_size=group)
    )
    quantizer.add_batch(x)
    result = quantizer.quantize(weight)
    fake = result.dequantized()
    assert result.dead_columns == 4
    assert bool(torch.isfinite(fake).all())
    assert bool((fake[:, [0, 5, 17, 63]] == 0).all())
    ref = reference_gptq(weight, hessian_of(x), 8, False, group, 0.01, 128)
    assert_matches_oracle(result, ref, exact=False, scale_rtol=5e-6)


def test_cholesky_retry_raises_damping_until_it_succeeds() -> None:
    weight, _ = make_layer(8, 64, rows=1)
    hessian = torch.eye(64)
    hessian[0, 0] = -0.3  # indefinite: fails until percdamp * mean(diag) > 0.3
    result = gptq_quantize(
        weight, hessian, percdamp=0.01, damp_auto_increment=0.1, max_damp_retries=5
    )
    mean_diag = float(hessian.diagonal().mean())
    assert result.damp_retries == 3
    assert result.percdamp == pytest.approx(0.31)
    assert result.damp == pytest.approx(0.31 * mean_diag)
    assert bool(torch.isfinite(result.dequantized()).all())


def test_cholesky_retry_on_rank_deficient_hessian() -> None:
    weight, x = make_layer(8, 64, rows=4)  # 4 tokens: rank 4 Hessian
    hessian = hessian_of(x)
    with pytest.raises(QuantizationError):
        gptq_quantize(weight, hessian, percdamp=1e-12, max_damp_retries=0)
    result = gptq_quantize(weight, hessian, percdamp=1e-12, damp_auto_increment=0.01)
    assert result.damp_retries >= 1 and result.percdamp > 0.005


def test_cholesky_failure_after_all_retries_names_layer_and_damping() -> None:
    weight, _ = make_layer(8, 64, rows=1)
    hessian = torch.eye(64)
    hessian[3, 3] = -5.0
    with pytest.raises(QuantizationError) as info:
        gptq_quantize(
            weight, hessian, percdamp=0.01, damp_auto_increment=0.01, max_damp_retries=2,
            name="model.layers.0.mlp.down_proj",
        )  # fmt: skip
    message = str(info.value)
    assert "model.layers.0.mlp.down_proj" in message
    assert "percdamp 0.03" in message and "after 2 damping increase(s)" in message
    assert "(8, 64)" in message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_and_activations(dtype: torch.dtype) -> None:
    weight, x = make_layer(16, 64, rows=256, seed=4)
    weight_half, x_half = weight.to(dtype), x.to(dtype)
    quantizer = WeightPerGroupGPTQ(8, True, group_size=32)
    quantizer.add_batch(x_half.reshape(4, 64, 64))
    result = quantizer.quantize(weight_half)
    expected = gptq_quantize(
        weight_half.float(), hessian_of(x_half.float()), bits=8, symmetric=True, group_size=32
    )
    assert result.dtype == dtype and result.dequantized().dtype == dtype
    assert result.dequantized(torch.float32).dtype == torch.float32
    assert result.quantized.scale.dtype == torch.float32
    mismatch = result.quantized.codes != expected.quantized.codes
    assert float(mismatch.float().mean()) <= 0.01


def test_attention_mask_excludes_padding_tokens() -> None:
    weight, x = make_layer(16, 64, rows=20, seed=9)
    padded = torch.full((2, 12, 64), 1e3)  # padding tokens carry huge values
    mask = torch.zeros(2, 12, dtype=torch.long)
    padded[0, :8], mask[0, :8] = x[:8], 1
    padded[1, 2:], mask[1, 2:] = x[8:18], 1
    masked = WeightPerChannelGPTQ(8, True)
    masked.add_batch(padded, attention_mask=mask)
    plain = WeightPerChannelGPTQ(8, True)
    plain.add_batch(x[:18])
    assert masked.nsamples == plain.nsamples == 18
    torch.testing.assert_close(masked.accumulator.hessian(), plain.accumulator.hessian())
    assert torch.equal(
        masked.quantize(weight).quantized.codes, plain.quantize(weight).quantized.codes
    )


@pytest.mark.parametrize("buffer_rows", [None, 0, 5])
def test_hessian_accumulator_equals_scaled_gram(buffer_rows: int | None) -> None:
    _, x = make_layer(4, 32, rows=100, seed=1)
    acc = HessianAccumulator(32, name="acc", buffer_rows=buffer_rows)
    acc.add_batch(x[:7])
    acc.add_batch(x[7:40].reshape(3, 11, 32))
    acc.add_batch(x[40:41])
    acc.add_batch(x[41:100].double())
    expected = (2.0 / 100) * (x.double().t() @ x.double())
    assert acc.n == acc.nsamples == 100
    torch.testing.assert_close(acc.hessian().double(), expected, rtol=1e-5, atol=1e-5)
    assert acc.hessian().dtype == torch.float32
    acc.free()
    assert acc.n == 0


def test_backend_runs_the_factorisations() -> None:
    calls: list[str] = []

    class SpyBackend(CpuBackend):
        def cholesky(self, matrix: torch.Tensor, upper: bool = False) -> torch.Tensor:
            calls.append("cholesky")
            return super().cholesky(matrix, upper)

        def solve_triangular(
            self, a: torch.Tensor, b: torch.Tensor, upper: bool, left: bool = True
        ) -> torch.Tensor:
            calls.append("solve_triangular")
            return super().solve_triangular(a, b, upper, left)

    weight, x = make_layer(16, 128, rows=512, seed=6)
    gptq_quantize(
        weight, hessian_of(x), group_size=32, block_size=32, backend=SpyBackend(DeviceSpec("cpu"))
    )
    assert calls.count("cholesky") == 1
    assert calls.count("solve_triangular") == 3  # one per group after the first lazy batch


def test_class_api_and_from_ext() -> None:
    per_group = WeightPerGroupGPTQ.from_ext(
        4, False, {"group_size": 32, "percdamp": 0.05, "block_size": None}, name="q_proj"
    )
    options = per_group.options
    assert (options.group_size, options.percdamp, options.block_size) == (32, 0.05, 128)
    assert "q_proj" in repr(per_group) and "group_size=32" in repr(per_group)
    per_channel = WeightPerChannelGPTQ.from_ext(8, True, {"group_size": 128, "desc_act": True})
    assert per_channel.options.desc_act and per_channel.group_size is None
    assert set(GPTQ_EXT_DEFAULTS) >= {"percdamp", "block_size", "group_size"}
    weight, x = make_layer(16, 64, rows=128)
    per_channel.add_batch(x)
    result = per_channel.quantize(weight)
    again = per_channel.quantize(weight)  # the accumulated Hessian is not consumed
    assert torch.equal(again.quantized.codes, result.quantized.codes)
    assert result.nsamples == 128 and result.seconds > 0
    assert result.quantized.scale.shape == (16, 1) and result.g_idx is None
    per_channel.free()
    assert per_channel.nsamples == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_solve_matches_cpu() -> None:
    weight, x = make_layer(64, 256, rows=1024, seed=8)
    hessian = hessian_of(x)
    cpu = gptq_quantize(weight, hessian, group_size=64, symmetric=False, solve_dtype=torch.float64)
    cuda = gptq_quantize(
        weight.cuda(), hessian.cuda(), group_size=64, symmetric=False, solve_dtype=torch.float64
    )
    assert torch.equal(cuda.quantized.codes.cpu(), cpu.quantized.codes)


# -- error messages -----------------------------------------------------------------------------


def test_activation_errors_name_the_layer() -> None:
    quantizer = WeightPerChannelGPTQ(name="layers.3.self_attn.o_proj", in_features=64)
    with pytest.raises(
        QuantizationError,
        match=r"layers\.3\.self_attn\.o_proj.*last dimension 32.*in_features = 64",
    ):
        quantizer.add_batch(torch.randn(2, 5, 32))
    bad = torch.randn(4, 64)
    bad[1, 2] = float("nan")
    bad[3, 0] = float("inf")
    with pytest.raises(QuantizationError, match=r"o_proj: calibration activations .* 2 NaN/Inf"):
        quantizer.add_batch(bad)
    with pytest.raises(
        QuantizationError, match=r"o_proj: attention_mask shape \(2, 4\) does not match .* \(2, 5\)"
    ):
        quantizer.add_batch(torch.randn(2, 5, 64), attention_mask=torch.ones(2, 4))
    with pytest.raises(QuantizationError, match=r"o_proj: activations must be a floating tensor"):
        quantizer.add_batch(torch.ones(3, 64, dtype=torch.int64))
    with pytest.raises(
        QuantizationError, match=r"o_proj: the GPTQ Hessian never received a calibration batch"
    ):
        quantizer.quantize(torch.randn(8, 64))


def test_weight_errors_name_the_layer_and_shape() -> None:
    quantizer = WeightPerGroupGPTQ(group_size=48, block_size=48, name="mlp.down_proj")
    quantizer.add_batch(torch.randn(16, 64))
    with pytest.raises(
        QuantizationError,
        match=r"mlp\.down_proj: group_size 48 does not divide in_features 64.*valid group sizes",
    ):
        quantizer.quantize(torch.randn(8, 64))
    with pytest.raises(QuantizationError, match=r"mlp\.down_proj: weight must be 2-D"):
        quantizer.quantize(torch.randn(64))
    with pytest.raises(QuantizationError, match=r"mlp\.down_proj: weight must be floating point"):
        quantizer.quantize(torch.ones(8, 64, dtype=torch.int32))
    nan_weight = torch.randn(8, 96)
    nan_weight[0, 0] = float("nan")
    other = WeightPerGroupGPTQ(group_size=48, name="mlp.down_proj")
    other.add_batch(torch.randn(4, 96))
    with pytest.raises(
        QuantizationError, match=r"mlp\.down_proj: weight \(8, 96\) contains 1 NaN/Inf"
    ):
        other.quantize(nan_weight)
    with pytest.raises(
        QuantizationError,
        match=r"mlp\.down_proj: GPTQ Hessian has shape \(64, 64\) but the weight \(8, 96\)",
    ):
        quantizer.quantize(torch.randn(8, 96))


def test_block_size_is_clipped_and_may_leave_a_short_last_block() -> None:
    weight, x = make_layer(8, 64, rows=128)
    assert gptq_quantize(weight, hessian_of(x), block_size=1000).block_size == 64
    assert gptq_quantize(weight, hessian_of(x), block_size=48).block_size == 48  # blocks 48 + 16
    with pytest.raises(
        QuantizationError,
        match=r"up_proj: GPTQ block_size must be a positive integer, got 0 \(weight shape \(8, 64\)\)",
    ):
        gptq_quantize(weight, hessian_of(x), block_size=0, name="up_proj")


def test_hessian_errors() -> None:
    weight, x = make_layer(8, 64, rows=128)
    hessian = hessian_of(x)
    hessian[2, 2] = float("nan")
    with pytest.raises(
        QuantizationError, match=r"k_proj: GPTQ Hessian \(64, 64\) contains NaN/Inf"
    ):
        gptq_quantize(weight, hessian, name="k_proj")
    with pytest.raises(QuantizationError, match=r"k_proj: in_features must be a positive int"):
        HessianAccumulator(0, name="k_proj")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"bits": 9}, "bits must be an int between 2 and 8, got 9"),
        ({"percdamp": 0}, "percdamp must be a number > 0, got 0"),
        ({"block_size": True}, "block_size must be an int > 0, got True"),
        ({"damp_auto_increment": -1.0}, "damp_auto_increment must be a number > 0"),
        ({"max_damp_retries": -1}, "max_damp_retries must be an int between 0 and 100, got -1"),
        ({"max_damp_retries": 101}, "max_damp_retries must be an int between 0 and 100, got 101"),
        ({"mse": True, "mse_grid": 1001}, "mse_grid must be an int between 1 and 1000, got 1001"),
        ({"group_size": 0}, "group_size must be an int > 0, got 0"),
    ],
)
def test_invalid_options_are_rejected(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(QuantizationError, match=r"v_proj: invalid GPTQ options: .*") as info:
        WeightPerGroupGPTQ(name="v_proj", **kwargs)  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_unknown_ext_key_is_rejected() -> None:
    with pytest.raises(
        QuantizationError,
        match=r"gate_proj: unknown GPTQ ext option\(s\) \['percdampp'\]; valid: percdamp",
    ):
        WeightPerGroupGPTQ.from_ext(8, True, {"percdampp": 0.1}, name="gate_proj")


@pytest.mark.parametrize("width", [64, 200, 576, 1000])
def test_blocked_symmetric_accumulation_equals_full_product(width: int) -> None:
    """Only the upper blocks are accumulated; reads mirror them, also after further batches."""
    torch.manual_seed(width)
    first, second = torch.randn(300, width), torch.randn(257, width)
    acc = HessianAccumulator(width, buffer_rows=128)
    acc.add_batch(first)
    raw, count = acc.raw_sum()
    assert count == 300 and torch.equal(raw, raw.T)
    torch.testing.assert_close(raw, first.T @ first, rtol=1e-5, atol=1e-4)
    acc.add_batch(second.unsqueeze(0))  # leading dims are flattened
    raw, count = acc.raw_sum()
    both = torch.cat([first, second])
    assert count == 557 and torch.equal(raw, raw.T)
    torch.testing.assert_close(raw, both.T @ both, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("group", [None, 16])
def test_solve_leaves_no_reference_cycle(group: int | None) -> None:
    """The solve's working copies are freed on return, not at the next garbage collection
    (its sweep is a recursive closure, a cycle unless broken)."""
    import gc

    weight, x = make_layer(24, 64, 256)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gptq_quantize(weight, hessian_of(x), bits=4, group_size=group, symmetric=True)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []
