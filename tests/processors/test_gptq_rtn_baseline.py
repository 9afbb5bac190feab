"""The round-to-nearest weight a GPTQ module's report compares with (``rtn_output_error``):
rounded with the solve's own grid parameters where they are round-to-nearest's (per-channel,
static groups without dead columns), so the MSE scale search runs once per module, not twice;
derived afresh where they are not (dynamic groups, dead columns under static groups)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import msquant.quant.mse_clip as mse_clip
from msquant.backends.cpu import CpuBackend
from msquant.plugin.devices import DeviceSpec
from msquant.processors.linear_quant.config import LinearQuantConfig
from msquant.processors.methods.gptq import GPTQMethod

VARIANTS = {
    "per-channel": ("per_channel", {}),
    "per-channel-act-order": ("per_channel", {"desc_act": True}),
    "static-groups": ("per_group", {"group_size": 32, "static_groups": True, "desc_act": False}),
    "act-order-groups": ("per_group", {"group_size": 32, "desc_act": True}),
    "dynamic-groups": ("per_group", {"group_size": 32, "desc_act": False}),
}
REUSED = {"per-channel", "per-channel-act-order", "static-groups", "act-order-groups"}


def _method(scope: str, ext: dict[str, Any], mse: bool, symmetric: bool) -> GPTQMethod:
    weight = {
        "dtype": "int4",
        "scope": scope,
        "symmetric": symmetric,
        "method": "gptq",
        "ext": {**ext, "mse": mse},
    }
    config = LinearQuantConfig.model_validate({"qconfig": {"weight": weight}})
    return GPTQMethod(config.qconfig.weight)


def _layer(dead: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A 48x128 weight with a few outliers and correlated calibration inputs (two of them
    always zero, dead, if asked)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 128, generator=gen)
    weight[
        torch.randint(0, 48, (6,), generator=gen), torch.randint(0, 128, (6,), generator=gen)
    ] *= 6
    x = torch.randn(512, 128, generator=gen) @ (
        torch.eye(128) + 0.1 * torch.randn(128, 128, generator=gen)
    )
    if dead:
        x[:, [5, 70]] = 0
    return weight, x


@pytest.fixture
def search_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the MSE searches (every search, the solver's and rounding's, goes through it)."""
    calls: list[int] = []
    original = mse_clip.mse_qparams

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(mse_clip, "mse_qparams", counted)
    yield calls


@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rtn_baseline_equals_a_fresh_rounding(
    variant: str, symmetric: bool, mse: bool, search_calls: list[int]
) -> None:
    scope, ext = VARIANTS[variant]
    method = _method(scope, ext, mse, symmetric)
    scheme = method.base_scheme().resolved()
    weight, x = _layer(dead=False)
    quantizer = method.new_quantizer("layer", 128, scheme)
    quantizer.add_batch(x)
    solved, stats = method.solve(quantizer, weight, method_backend())
    searches_in_solve = len(search_calls)
    baseline = method.rtn_baseline(weight, scheme, "layer", solved, stats)
    fresh = method.quantize_rtn(weight, scheme, "layer")
    # Plain min/max parameters are exact in any layout; the searched ones pick the same shrink
    # here (no near-tie between candidates on this weight).
    for field in ("codes", "scale", "offset"):
        assert torch.equal(getattr(baseline, field), getattr(fresh, field)), field
    assert (baseline.bits, baseline.symmetric, baseline.group_size) == (
        fresh.bits,
        fresh.symmetric,
        fresh.group_size,
    )
    if mse and variant in REUSED:
        # The rounding reused the solve's search: one search per module instead of two.
        rounding_searches = len(search_calls) - searches_in_solve
        assert rounding_searches == 1  # the fresh quantize_rtn above, not rtn_baseline
        assert searches_in_solve >= 1


@pytest.mark.parametrize("variant", ["static-groups", "act-order-groups"])
def test_dead_columns_under_static_groups_round_afresh(variant: str) -> None:
    """The solver zeroes dead inputs before fixing static groups, so its parameters are not
    round-to-nearest's: the baseline is rounded from the original weight."""
    scope, ext = VARIANTS[variant]
    method = _method(scope, ext, mse=False, symmetric=True)
    scheme = method.base_scheme().resolved()
    weight, x = _layer(dead=True)
    quantizer = method.new_quantizer("layer", 128, scheme)
    quantizer.add_batch(x)
    solved, stats = method.solve(quantizer, weight, method_backend())
    assert stats["dead_columns"] == 2
    assert not torch.equal(solved.scale, method.quantize_rtn(weight, scheme, "l").scale)
    baseline = method.rtn_baseline(weight, scheme, "layer", solved, stats)
    fresh = method.quantize_rtn(weight, scheme, "layer")
    assert torch.equal(baseline.codes, fresh.codes)
    assert torch.equal(baseline.scale, fresh.scale)


def method_backend() -> CpuBackend:
    return CpuBackend(DeviceSpec("cpu"))
