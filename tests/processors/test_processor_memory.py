"""What the processors say they hold (``memory_bytes``, for ``--max_memory``) against what a real
run holds: GPTQ's Hessians (shared by q/k/v and gate/up, spread over ``experts_per_pass``) and
``flex_smooth_quant``'s search rows, measured on tiny models while the run works."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS

import msquant
from msquant.config.processors import build_processors
from msquant.config.resolve import resolve_config
from msquant.contracts.registry import default_registry
from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import build_meta_model, load_model_config, load_tokenizer
from msquant.model.adapter_registry import adapter_for
from msquant.plugin import CalibrationSize, Processor

MAX_TOKENS = 48
OVERRIDES: dict[str, dict[str, object]] = {"mixtral": {"intermediate_size": 32}}


def _gptq_config(experts_per_pass: int | None = None) -> dict[str, Any]:
    ext: dict[str, Any] = {"expert_min_tokens": 0.0}
    if experts_per_pass is not None:
        ext["experts_per_pass"] = experts_per_pass
    weight = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "gptq"}
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": {**weight, "ext": ext}}}],
            "save": [{"type": "ascendv1_saver"}],
        },
    }


def _processors(config: dict[str, Any]) -> list[Processor]:
    registry = default_registry()
    return build_processors(resolve_config(config, registry).config, registry)


def _calibration(model_dir: Path) -> CalibrationSize:
    """The calibration size of the runs below (the tiny models are float32)."""
    texts = read_calibration_texts(CALIB_TXT)
    lengths = [
        int(s.numel()) for s in tokenize_samples(texts, load_tokenizer(model_dir), MAX_TOKENS)
    ]
    return CalibrationSize(sum(lengths), max(lengths), 4096, 4)


def _held_hessians(collector: Any) -> tuple[int, list[set[str]]]:
    """Bytes of the Hessian sums and staging buffers alive in ``collector``, and the modules
    sharing each fed accumulator (the accumulator's internals are read: this is a measurement)."""
    held: dict[int, int] = {}
    sharing: dict[int, set[str]] = {}
    for name, quantizer in collector.quantizers.items():
        accumulator = quantizer.accumulator
        tensors = [t for t in (accumulator._sum, accumulator._buffer) if t is not None]
        held[id(accumulator)] = sum(t.numel() * t.element_size() for t in tensors)
        if accumulator.n:
            sharing.setdefault(id(accumulator), set()).add(name)
    return sum(held.values()), sorted(sharing.values(), key=sorted)


@pytest.mark.parametrize(
    ("arch", "experts_per_pass"),
    [
        ("llama", None),
        pytest.param("qwen3_moe", None, marks=NEEDS_MOE_TRANSFORMERS),
        pytest.param("qwen3_moe", 3, marks=NEEDS_MOE_TRANSFORMERS),
        pytest.param("mixtral", None, marks=NEEDS_MOE_TRANSFORMERS),
        pytest.param("deepseek_v3", None, marks=NEEDS_MOE_TRANSFORMERS),
    ],
)
def test_gptq_hessians_estimated_are_those_a_run_holds(
    arch: str,
    experts_per_pass: int | None,
    tiny_model_factory: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For every calibration pass of a GPTQ run, the Hessians alive once its modules are solved
    (sums and staging buffers, before the pass frees them) take at most what ``linear_quant``
    estimates for the busiest pass of the layer, exactly that in the busiest pass once every
    module received tokens; and the modules that really share a Hessian (same input tensor)
    are the ones the estimate counts once."""
    from msquant.processors.linear_quant import processor as linear_quant
    from msquant.processors.linear_quant.calibration import plan_passes
    from msquant.processors.linear_quant.memory import hessian_owners

    model_dir = tiny_model_factory(arch, num_layers=2, **OVERRIDES.get(arch, {}))
    solve = linear_quant.solve_modules
    passes: list[tuple[str, int, list[set[str]], bool]] = []

    def recording(*args: Any) -> Any:
        layer, collector = args[1], args[4]  # (ctx, layer, modules, method, collector, report_of)
        clear = collector.clear

        def measured_clear() -> None:  # the pass's solves are done, nothing is freed yet
            held, sharing = _held_hessians(collector)
            everyone_fed = all(q.nsamples for q in collector.quantizers.values())
            passes.append((layer.name, held, sharing, everyone_fed))
            clear()

        collector.clear = measured_clear
        try:
            return solve(*args)
        finally:
            del collector.clear

    monkeypatch.setattr(linear_quant, "solve_modules", recording)
    config = _gptq_config(experts_per_pass)
    msquant.quantize(
        model_dir, tmp_path / "out", config, calib_path=CALIB_TXT,
        max_calib_tokens=MAX_TOKENS, progress=False,
    )  # fmt: skip

    meta = build_meta_model(load_model_config(model_dir))
    layers = adapter_for(meta).decoder_layers(meta)
    (processor,) = [p for p in _processors(config) if p.type_name == "linear_quant"]
    calibration = _calibration(model_dir)
    for layer in layers:
        estimated = processor.memory_bytes(meta, layer, calibration)["gptq Hessians (busiest pass)"]
        runs = [p for p in passes if p[0] == layer.name]
        assert len(runs) == processor.calibration_passes(layer)
        assert all(held <= estimated for _, held, _, _ in runs)
        busiest = max(runs, key=lambda p: p[1])
        if busiest[3]:
            assert busiest[1] == estimated
        names = [name for name, _, _ in processor.selected(layer)]  # type: ignore[attr-defined]
        method = processor.method  # type: ignore[attr-defined]
        plan, _ = plan_passes(layer, names, method.true_sequential, method.experts_per_pass)
        owners = hessian_owners(names, plan)
        # the modules that received tokens share accumulators exactly as the owners say
        fed = {name for _, _, sharing, _ in runs for group in sharing for name in group}
        expected_groups: dict[str, set[str]] = {}
        for name in fed:
            expected_groups.setdefault(owners[name], set()).add(name)
        seen = sorted((group for _, _, sharing, _ in runs for group in sharing), key=sorted)
        assert seen == sorted(expected_groups.values(), key=sorted)


def test_flex_search_rows_estimated_are_those_a_run_keeps(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flex_smooth_quant`` (alpha and beta searched) keeps every calibration token's input row
    of each smoothed subgraph until its pass ends: the bytes recorded when the pass ends are the
    estimate's "search rows" of the layer, byte for byte; with alpha and beta given it keeps
    none and the estimate counts none."""
    from msquant.processors.smoothing.processor import FlexSmoothQuantProcessor

    kept: list[int] = []
    after_pass = FlexSmoothQuantProcessor.after_pass

    def recording(self: Any, ctx: Any, layer: Any, index: int) -> None:
        rows = [t for batches in self._statistics.rows.values() for t in batches]
        kept.append(sum(t.numel() * t.element_size() for t in rows))
        after_pass(self, ctx, layer, index)

    monkeypatch.setattr(FlexSmoothQuantProcessor, "after_pass", recording)
    act = {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"}
    weight = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {"type": "flex_smooth_quant"},
                {"type": "linear_quant", "qconfig": {"act": act, "weight": weight}},
            ]
        },
    }
    msquant.quantize(
        tiny_llama, tmp_path / "out", config, calib_path=CALIB_TXT,
        max_calib_tokens=MAX_TOKENS, progress=False,
    )  # fmt: skip

    meta = build_meta_model(load_model_config(tiny_llama))
    layers = adapter_for(meta).decoder_layers(meta)
    smoothing = _processors(config)[0]
    calibration = _calibration(tiny_llama)
    estimated = [
        smoothing.memory_bytes(meta, layer, calibration)["search rows (every calibration token)"]
        for layer in layers
    ]
    # q_proj, gate_proj (64 wide), o_proj (64) and down_proj (128) inputs, float32
    assert estimated == [calibration.tokens * (64 + 64 + 64 + 128) * 4] * len(layers)
    assert kept == estimated

    config["spec"]["process"][0] = {"type": "flex_smooth_quant", "alpha": 0.5, "beta": 0.5}
    given = _processors(config)[0].memory_bytes(meta, layers[0], calibration)
    assert "search rows (every calibration token)" not in given
    assert given["channel maxima"] == (64 + 64 + 64 + 128) * 4


def test_flex_awq_ssz_estimate_counts_every_row_and_the_mean(tiny_llama: Path) -> None:
    """``flex_awq_ssz`` keeps every input row even with ``alpha`` given (the scales use the mean
    of ``|x|`` over all of them), and its largest working set is at least the join of the widest
    subgraph's rows and their ``|x|``."""
    act = {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"}
    weight = {"scope": "per_channel", "dtype": "int4", "symmetric": True, "method": "ssz"}
    entry = {"type": "flex_awq_ssz", "alpha": 0.5, "qconfig": {"act": act, "weight": weight}}
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [entry, {"type": "linear_quant", "qconfig": {"act": act, "weight": weight}}]
        },
    }
    meta = build_meta_model(load_model_config(tiny_llama))
    layers = adapter_for(meta).decoder_layers(meta)
    calibration = _calibration(tiny_llama)
    items = _processors(config)[0].memory_bytes(meta, layers[0], calibration)
    assert (
        items["search rows (every calibration token)"]
        == calibration.tokens * (64 + 64 + 64 + 128) * 4
    )
    assert items["awq mean and search (largest subgraph)"] >= 2 * calibration.tokens * 128 * 4
