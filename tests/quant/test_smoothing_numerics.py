"""The smoothing numerics (msquant.quant.smoothing) against float64 references written from the
definitions, and the property smoothing exists for: the smoothed product computes the same
function, and int8 per-token activations get far more accurate on activations with outliers."""

from __future__ import annotations

import math

import pytest
import torch

from msquant.quant.smoothing import (
    SCREEN_BLOCKS,
    SCREEN_MARGIN,
    SmoothingSearch,
    _grid,
    _quant_int8_sym_rows_,
    abs_column_max,
    flex_scales,
    fold_into_linear_columns,
    fold_into_linear_rows,
    fold_into_norm,
    iter_scales,
    iter_weight_stat,
    ov_scales_max,
    ov_scales_mean,
    quant_int8_sym_rows,
    search_alpha_beta,
    smoothing_error,
    update_channel_max,
)


def _outlier_activations(tokens: int = 256, channels: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=generator)
    x[:, 3] *= 60.0  # two outlier channels, as LLM activations have
    x[:, 17] *= 25.0
    return x


def _int8_rows_64(x: torch.Tensor) -> torch.Tensor:
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / step).clamp(-127, 127) * step


def test_channel_max_accumulates_over_batches() -> None:
    x = _outlier_activations()
    running = None
    for part in x.split(64):
        running = update_channel_max(running, part.reshape(8, 8, -1))
    assert running is not None
    assert torch.equal(running, x.abs().amax(dim=0))


def test_iter_scales_match_the_definition() -> None:
    generator = torch.Generator().manual_seed(1)
    act = torch.rand(16, generator=generator) * 10
    act[5] = 0.0  # a dead channel: the scale is floored at scale_min
    weights = [torch.randn(8, 16, generator=generator), torch.randn(4, 16, generator=generator)]
    stat = abs_column_max(weights)
    w64 = torch.cat([w.double() for w in weights]).abs().amax(dim=0).clamp(min=1e-5)
    torch.testing.assert_close(stat.double(), w64)
    scales = iter_scales(act, stat, alpha=0.9, scale_min=1e-3)
    expected = (act.double() ** 0.9 / w64**0.1).clamp(min=1e-3)
    torch.testing.assert_close(scales.double(), expected, rtol=1e-6, atol=0)
    assert scales[5] == pytest.approx(1e-3)


def test_iter_weight_stat_of_a_linear_pair_is_the_signed_column_maximum() -> None:
    """msModelSlim takes max(dim=0) of the second linear's signed weights for up-down / ov /
    linear-linear (not the absolute maximum); a column that is all negative floors at 1e-5."""
    weight = torch.tensor([[1.0, -3.0, -2.0], [-4.0, -1.0, 0.5]])
    assert iter_weight_stat([weight], signed=True).tolist() == pytest.approx([1.0, 1e-5, 0.5])
    assert iter_weight_stat([weight], signed=False).tolist() == pytest.approx([4.0, 3.0, 2.0])


def test_flex_scales_match_the_definition() -> None:
    act = torch.tensor([4.0, 0.0, 9.0])
    weight_stat = torch.tensor([0.5, 2.0, 1e-5])
    scales = flex_scales(act, weight_stat, alpha=0.5, beta=0.25)
    expected = [(4.0**0.5) / (0.5**0.25), 1e-5, 3.0 / (1e-5**0.25)]
    assert scales.tolist() == pytest.approx(expected, rel=1e-6)


def test_ov_scales_reduce_over_the_query_heads_of_each_kv_head() -> None:
    heads, kv_heads, head_dim = 4, 2, 3
    generator = torch.Generator().manual_seed(2)
    scales = torch.rand(heads * head_dim, generator=generator) + 0.5
    o_scales, v_scales = ov_scales_mean(scales, heads, kv_heads)
    per_head = scales.double().reshape(heads, head_dim)
    for kv in range(kv_heads):
        mean = per_head[2 * kv : 2 * kv + 2].mean(dim=0)  # query heads 2kv, 2kv+1 read kv head kv
        torch.testing.assert_close(v_scales[kv * head_dim : (kv + 1) * head_dim].double(), mean)
        for h in (2 * kv, 2 * kv + 1):
            torch.testing.assert_close(o_scales[h * head_dim : (h + 1) * head_dim].double(), mean)
    act = torch.rand(heads * head_dim, generator=generator) * 5
    weight = torch.rand(heads * head_dim, generator=generator) + 0.1
    o_max, v_max = ov_scales_max(act, weight, 0.7, 0.3, heads, kv_heads)
    a = act.double().reshape(kv_heads, 2, head_dim).amax(dim=1)
    w = weight.double().reshape(kv_heads, 2, head_dim).amax(dim=1)
    grouped = (a**0.7 / w**0.3).reshape(-1)
    torch.testing.assert_close(v_max.double(), grouped, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        o_max.double(),
        grouped.reshape(kv_heads, 1, head_dim).expand(-1, 2, -1).reshape(-1),
        rtol=1e-6,
        atol=0,
    )
    with pytest.raises(ValueError, match="cannot be split into 4 attention heads sharing 3"):
        ov_scales_mean(scales, 4, 3)


def test_folds_keep_the_float_function() -> None:
    """norm -> linear and linear -> linear folds: the smoothed float64 modules compute what the
    originals do (to float64 rounding)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(10, 8, generator=generator, dtype=torch.float64)
    norm_w, norm_b = (
        torch.rand(8, generator=generator, dtype=torch.float64) + 0.5,
        torch.randn(8, generator=generator, dtype=torch.float64),
    )
    first = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    first_b = torch.randn(6, generator=generator, dtype=torch.float64)
    second = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    reference = ((x * norm_w + norm_b) @ first.T + first_b) @ second.T
    s1 = torch.rand(8, generator=generator, dtype=torch.float64) * 4 + 0.1
    s2 = torch.rand(6, generator=generator, dtype=torch.float64) * 4 + 0.1
    fold_into_norm(norm_w, norm_b, s1)
    fold_into_linear_columns(first, s1)
    fold_into_linear_rows(first, first_b, s2)
    fold_into_linear_columns(second, s2)
    smoothed = ((x * norm_w + norm_b) @ first.T + first_b) @ second.T
    torch.testing.assert_close(smoothed, reference, rtol=1e-12, atol=1e-12)


def _error_64(act: torch.Tensor, weight: torch.Tensor, alpha: float, beta: float) -> float:
    act, weight = act.double(), weight.double()
    golden = act @ weight.T
    scale = act.abs().amax(dim=0) ** alpha * weight.abs().amax(dim=0) ** (-beta)
    product = _int8_rows_64(act / scale) @ _int8_rows_64(weight * scale).T
    return float(((product - golden) ** 2).mean().sqrt() / (golden**2).mean().sqrt())


def test_smoothing_error_matches_a_float64_reference_and_smoothing_helps() -> None:
    act = _outlier_activations()
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(4)) * 0.05
    for alpha, beta in ((0.0, 0.0), (0.5, 0.5), (0.8, 0.1)):
        assert smoothing_error(act, weight, alpha, beta) == pytest.approx(
            _error_64(act, weight, alpha, beta), rel=1e-3
        )
    unsmoothed = smoothing_error(act, weight, 0.0, 0.0)
    assert smoothing_error(act, weight, 0.5, 0.5) < unsmoothed / 3


def test_search_alpha_beta_finds_the_grid_optimum() -> None:
    """The search (alpha with beta = 1 - alpha, then beta) agrees with an exhaustive float64
    evaluation of the same two sweeps, and beats no smoothing."""
    act = _outlier_activations(seed=5)
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(6)) * 0.05
    alpha, beta, error = search_alpha_beta(act, weight)
    grid = [round(i * 0.05, 2) for i in range(21)]
    alpha_errors = {a: _error_64(act, weight, a, 1.0 - a) for a in grid}
    best_alpha = min(grid, key=lambda a: (alpha_errors[a], -a))
    assert alpha == best_alpha
    beta_errors = {b: _error_64(act, weight, alpha, b) for b in grid}
    assert beta_errors[beta] <= min(beta_errors.values()) * (1 + 1e-4)
    assert error == pytest.approx(beta_errors[beta], rel=1e-3)
    assert error < smoothing_error(act, weight, 0.0, 0.0) / 3


def _search_one_by_one(act: torch.Tensor, weight: torch.Tensor) -> tuple[float, float, float]:
    """msModelSlim's two sweeps written plainly: every candidate through smoothing_error."""
    reference = act @ weight.T
    best_alpha, best = 0.0, float("inf")
    for alpha in _grid():
        error = smoothing_error(act, weight, alpha, 1.0 - alpha, reference)
        if error <= best:
            best_alpha, best = alpha, error
    best_beta = 0.0
    for beta in _grid():
        error = smoothing_error(act, weight, best_alpha, beta, reference)
        if error <= best:
            best_beta, best = beta, error
    return best_alpha, best_beta, best


@pytest.mark.parametrize(("tokens", "channels", "out"), [(300, 48, 96), (257, 96, 40), (64, 32, 8)])
def test_shared_search_errors_are_bit_identical_to_smoothing_error(
    tokens: int, channels: int, out: int
) -> None:
    """The shared statistics, the buffers and the in-place quantization change no bit of any
    candidate's error (msModelSlim's argmin depends on exact ties)."""
    act = _outlier_activations(tokens, channels, seed=tokens)
    weight = torch.randn(out, channels, generator=torch.Generator().manual_seed(out)) * 0.05
    weight[:, 7] *= 30.0  # a weight outlier column
    search = SmoothingSearch(act, weight)
    reference = act @ weight.T
    for alpha in _grid()[::3]:
        for beta in (0.0, 0.35, 1.0 - alpha, 1.0):
            assert search.error(alpha, beta) == smoothing_error(act, weight, alpha, beta, reference)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_alpha_beta_equals_the_candidate_by_candidate_search(seed: int) -> None:
    act = _outlier_activations(200, 40, seed=10 + seed)
    weight = torch.randn(72, 40, generator=torch.Generator().manual_seed(20 + seed)) * 0.05
    assert search_alpha_beta(act, weight) == _search_one_by_one(act, weight)


def _count_computed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    computed: list[tuple[float, float]] = []
    original = SmoothingSearch._compute

    def counting(self: SmoothingSearch, alpha: float, beta: float) -> float:
        computed.append((alpha, beta))
        return original(self, alpha, beta)

    monkeypatch.setattr(SmoothingSearch, "_compute", counting)
    return computed


def test_screened_search_computes_few_pairs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 on CPU: the screen leaves a few of the 41 candidates to compute in float32, each
    once, the chosen pair among them; the answer is the plain sweep's."""
    act = _outlier_activations(seed=7)
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(8)) * 0.05
    computed = _count_computed(monkeypatch)
    alpha, beta, error = search_alpha_beta(act, weight)
    assert len(computed) == len(set(computed))
    assert (alpha, beta) in computed
    assert 1 <= len(computed) <= 6
    assert (alpha, beta, error) == _search_one_by_one(act, weight)


def test_bfloat16_search_computes_every_pair_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No screen in bfloat16 (its products round far beyond the margin): every pair of the two
    sweeps computed, once (the beta sweep's (alpha, 1 - alpha), where it is the same float, is
    not computed again)."""
    act = _outlier_activations(seed=7).to(torch.bfloat16)
    weight = (torch.randn(24, 32, generator=torch.Generator().manual_seed(8)) * 0.05).to(
        torch.bfloat16
    )
    computed = _count_computed(monkeypatch)
    alpha, _, _ = search_alpha_beta(act, weight)
    pairs = {(a, 1.0 - a) for a in _grid()} | {(alpha, b) for b in _grid()}
    assert len(computed) == len(set(computed))
    assert set(computed) == pairs


def _heavy_outliers(tokens: int, channels: int, seed: int) -> torch.Tensor:
    """Activations with a few channels hundreds of times larger and heavy-tailed tokens."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=generator)
    x *= torch.rand(tokens, 1, generator=generator) * 4
    columns = torch.randperm(channels, generator=generator)[:3]
    x[:, columns] *= torch.tensor([300.0, 80.0, 20.0])
    x[torch.randint(0, tokens, (5,), generator=generator)] *= 50.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "seed"),
    [("random", 0), ("random", 1), ("outliers", 2), ("outliers", 3), ("outliers", 4)],
)
def test_search_alpha_beta_equals_the_plain_sweep(rows: str, seed: int, dtype: torch.dtype) -> None:
    """The screened search picks the same (alpha, beta) with the same error, bit for bit, as
    every candidate through smoothing_error, on random and on outlier-heavy rows (float32
    screens, bfloat16 computes every candidate)."""
    tokens, channels, out = (160 + 37 * seed, 48 + 8 * seed, 40 + 24 * seed)
    act = (
        torch.randn(tokens, channels, generator=torch.Generator().manual_seed(seed))
        if rows == "random"
        else _heavy_outliers(tokens, channels, seed)
    ).to(dtype)
    weight = torch.randn(out, channels, generator=torch.Generator().manual_seed(50 + seed)) * 0.05
    weight[:, seed] *= 40.0  # a weight outlier column
    weight = weight.to(dtype)
    assert search_alpha_beta(act, weight) == _search_one_by_one(act, weight)


def test_exact_ties_resolve_as_the_plain_sweep() -> None:
    """Every column maximum 1: every candidate's scale is 1 and all 41 errors are equal; the
    plain sweep then keeps the last grid point of each sweep, and so does the screened one."""
    generator = torch.Generator().manual_seed(9)
    act = torch.rand(64, 16, generator=generator) * 2 - 1
    act[0] = 1.0
    weight = torch.rand(24, 16, generator=generator) * 2 - 1
    weight[0] = -1.0
    assert search_alpha_beta(act, weight) == _search_one_by_one(act, weight)
    assert search_alpha_beta(act, weight)[:2] == (1.0, 1.0)


def test_estimate_is_the_error_up_to_float32_rounding() -> None:
    """The screen's premise: the exact-product estimate is within float32 rounding of the float32
    objective (far inside SCREEN_MARGIN), for smoothed and unsmoothed candidates."""
    act = _heavy_outliers(300, 64, seed=5)
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(6)) * 0.05
    search = SmoothingSearch(act, weight)
    for alpha in _grid()[::2]:
        for beta in (0.0, 1.0 - alpha, 1.0):
            error, estimate = search.error(alpha, beta), search.estimate(alpha, beta)
            assert estimate == pytest.approx(error, rel=1e-5)
    assert 1e-5 * 100 <= SCREEN_MARGIN


def test_estimate_stops_at_the_limit_with_a_lower_bound() -> None:
    """Past ``limit`` the estimate returns the partial sum over the first row blocks: above the
    limit, at most the whole estimate; asked again with no limit, it computes the whole."""
    act = _heavy_outliers(256, 32, seed=8)
    weight = torch.randn(40, 32, generator=torch.Generator().manual_seed(9)) * 0.05
    whole = SmoothingSearch(act, weight).estimate(0.0, 0.0)
    search = SmoothingSearch(act, weight)
    partial = search.estimate(0.0, 0.0, limit=whole * 0.1)
    assert whole * 0.1 < partial < whole
    assert search.estimate(0.0, 0.0) == whole


def test_an_all_zero_row_computes_every_candidate() -> None:
    """A zero row makes every error NaN (0/0 codes, as msModelSlim's): no screen, the plain
    sweep's answer (nothing is at most the initial infinity)."""
    act = _outlier_activations(64, 32, seed=3)
    act[5] = 0.0
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    assert math.isnan(SmoothingSearch(act, weight).estimate(0.5, 0.5))
    assert search_alpha_beta(act, weight) == _search_one_by_one(act, weight) == (0.0, 0.0, math.inf)


def test_in_place_row_quantization_equals_quant_int8_sym_rows() -> None:
    """Same values as the out-of-place definition, also for an all-zero row (0/0) and a row
    whose step underflows to 0 (where the clamp acts), NaN for NaN."""
    x = _outlier_activations(16, 24, seed=3)
    x[4] = 0.0
    x[9] = 0.0
    x[9, 2] = 1e-44  # max / 127 underflows to a zero step
    expected = quant_int8_sym_rows(x.clone())
    actual = _quant_int8_sym_rows_(x.clone())
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(actual[4]).all()
    assert actual[9, 2] == 0.0 and torch.isnan(actual[9, 0])


def _bf16_rows_where_the_clamp_acts() -> torch.Tensor:
    """bfloat16 rows some of whose values divide by ``max / 127`` to 127.5, which rounds to 128
    (``max / 127`` rounded to 8 significant bits can be that much too small)."""
    x = _outlier_activations(512, 64, seed=11).to(torch.bfloat16)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert bool((torch.round(x / step).abs() > 127).any())  # the case exists in these rows
    return x


def test_in_place_row_quantization_clamps_in_bfloat16() -> None:
    x = _bf16_rows_where_the_clamp_acts()
    expected = quant_int8_sym_rows(x.clone())
    actual = _quant_int8_sym_rows_(x.clone())
    assert actual.dtype == torch.bfloat16
    assert torch.equal(actual, expected)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert not torch.equal(torch.round(x / step) * step, expected)  # the clamp changed values


def test_shared_search_is_bit_identical_in_bfloat16() -> None:
    """bf16 models search in bf16 (msModelSlim casts the rows to the weight's dtype): every
    candidate's error and the chosen (alpha, beta) equal the plain definition's."""
    act = _bf16_rows_where_the_clamp_acts()
    weight = (torch.randn(48, 64, generator=torch.Generator().manual_seed(12)) * 0.05).to(
        torch.bfloat16
    )
    search = SmoothingSearch(act, weight)
    reference = act @ weight.T
    differing = [
        (alpha, beta)
        for alpha in _grid()
        for beta in (0.0, 0.25, 1.0 - alpha, 1.0)
        if search.error(alpha, beta) != smoothing_error(act, weight, alpha, beta, reference)
    ]
    assert differing == []
    assert search_alpha_beta(act, weight) == _search_one_by_one(act, weight)


def _near_ties(
    tokens: int, channels: int, out: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adversarial for a pruned search: every column maximum of ``|act|`` and ``|weight|`` within
    2e-4 of 1, so every scale is within about 2e-4 of 1 and the 41 candidates' errors differ by
    a few 1e-4 (several within the screen's margin of the best)."""
    generator = torch.Generator().manual_seed(seed)
    act = torch.rand(tokens, channels, generator=generator) * 2 - 1
    act[0] = 1 + torch.rand(channels, generator=generator) * 2e-4
    weight = torch.rand(out, channels, generator=generator) * 2 - 1
    weight[0] = -(1 + torch.rand(channels, generator=generator) * 2e-4)
    return act, weight


def _late_outlier(
    tokens: int, channels: int, out: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adversarial for partial sums: one token 50x larger than the others, dealt to the last row
    block, so that the first blocks' partial sums say little about the whole."""
    generator = torch.Generator().manual_seed(seed)
    act = torch.randn(tokens, channels, generator=generator)
    count = min(SCREEN_BLOCKS, tokens)
    act[(tokens - count) // count * count + count - 1] *= 50.0
    weight = torch.randn(out, channels, generator=generator) * 0.05
    return act, weight


@pytest.mark.parametrize("seed", range(16))
def test_pruned_search_equals_the_plain_sweep_on_random_shapes(seed: int) -> None:
    """The best-first, block-by-block pruned search against every candidate through
    smoothing_error, on shapes that block the tokens (more tokens than outputs), the weight's
    rows (more outputs), fewer rows than blocks, and rows that are random, outlier-heavy or
    adversarial (near-tied candidates; the error concentrated in the last block)."""
    generator = torch.Generator().manual_seed(100 + seed)
    tokens = int(torch.randint(3, 200, (1,), generator=generator))
    out = int(torch.randint(2, 240, (1,), generator=generator))
    channels = int(torch.randint(8, 72, (1,), generator=generator))
    kind = ("random", "outliers", "ties", "late")[seed % 4]
    if kind in ("ties", "late"):
        act, weight = (_near_ties if kind == "ties" else _late_outlier)(tokens, channels, out, seed)
    else:
        act = (
            torch.randn(tokens, channels, generator=generator)
            if kind == "random"
            else _heavy_outliers(tokens, channels, seed)
        )
        weight = torch.randn(out, channels, generator=generator) * 0.05
        weight[:, seed % channels] *= 30.0
    assert search_alpha_beta(act, weight) == _search_one_by_one(act, weight)


@pytest.mark.parametrize(("tokens", "out"), [(300, 40), (40, 300)])
def test_paused_estimates_resume_to_the_whole(tokens: int, out: int) -> None:
    """Both block layouts (by tokens, by the weight's rows): an estimate stopped after one block
    or at a limit is a lower bound of the whole and, resumed, equals the whole computed at once
    (same blocks, same order), also after the kept codes were dropped."""
    act = _heavy_outliers(tokens, 32, seed=tokens)
    weight = torch.randn(out, 32, generator=torch.Generator().manual_seed(out)) * 0.05
    whole = SmoothingSearch(act, weight).estimate(0.4, 0.6)
    assert whole == pytest.approx(SmoothingSearch(act, weight).error(0.4, 0.6), rel=1e-5)
    search = SmoothingSearch(act, weight)
    first = search.estimate(0.4, 0.6, blocks=1)
    assert 0 < first < whole and not search.complete(0.4, 0.6)
    search.forget_codes()
    assert whole * 0.3 < search.estimate(0.4, 0.6, limit=whole * 0.3) < whole
    assert search.estimate(0.4, 0.6) == whole and search.complete(0.4, 0.6)


def test_near_ties_keep_several_candidates_and_resolve_as_the_plain_sweep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where candidates are within the screen's margin of each other, each of them is computed in
    float32 (the argmin among near-ties is decided by the exact objective, as msModelSlim's)."""
    act, weight = _near_ties(256, 48, 64, seed=3)
    computed = _count_computed(monkeypatch)
    answer = search_alpha_beta(act, weight)
    assert answer == _search_one_by_one(act, weight)
    assert len(computed) >= 2


def test_alpha_pick_error_only_where_the_beta_sweep_needs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows where a beta beats the alpha sweep's pick by far more than the margin: the pick of
    the alpha sweep is never computed in float32, and the answer is the plain sweep's."""
    act = _outlier_activations(256, 32, seed=21)
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(22)) * 0.05
    weight[:, 5] *= 0.2
    computed = _count_computed(monkeypatch)
    alpha, beta, error = search_alpha_beta(act, weight)
    assert (alpha, beta, error) == _search_one_by_one(act, weight)
    assert (alpha, 1.0 - alpha) not in computed
    assert computed == [(alpha, beta)]
