"""--max_memory: the peak estimate made before weights load, and the early refusal."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS, CliResult
from transformers import AutoConfig

from msquant import MsquantInputError
from msquant.load.model_folder import build_meta_model, load_model_config
from msquant.model.layers import find_decoder_layers
from msquant.run.memory_estimate import (
    GIB,
    MemoryEstimate,
    check_memory,
    estimate_memory,
    parse_memory,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64GiB", 64 * 2**30), ("500MB", 500 * 10**6), ("16g", 16 * 10**9), ("1.5 GiB", 3 * 2**29),
     ("4096", 4096), ("2kib", 2048)],
)  # fmt: skip
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "12 parsecs", "-3GB", "1e9"])
def test_parse_memory_refuses_other_text(text: str) -> None:
    with pytest.raises(MsquantInputError, match="is not a memory size; write e.g. 64GiB"):
        parse_memory(text)


def _estimate(layers: int, streaming: bool, tokens: int = 4096) -> MemoryEstimate:
    config = AutoConfig.for_model(
        "llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
    )  # fmt: skip
    meta = build_meta_model(config)
    params = sum(p.numel() for p in meta.parameters())
    return estimate_memory(
        meta, find_decoder_layers(meta), params * 2,  # a bfloat16 checkpoint
        streaming=streaming, calibration_tokens=tokens, gptq=True,
    )  # fmt: skip


def test_streamed_estimate_does_not_grow_with_depth() -> None:
    shallow, deep = _estimate(4, streaming=True), _estimate(16, streaming=True)
    assert deep.total == shallow.total
    whole_shallow, whole_deep = _estimate(4, streaming=False), _estimate(16, streaming=False)
    assert whole_deep.weights == 4 * whole_shallow.weights
    layer_bf16 = (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024) * 2
    assert whole_shallow.weights == 4 * layer_bf16
    assert shallow.weights == int(layer_bf16 / 2 * (2 + 1.25))  # float layer + quantized copy
    assert shallow.activations == 2 * 4096 * 1024 * 4
    # Hessians of the 7 linears (4 of width 1024, ... down_proj 2816) + solve copies
    hessians = (6 * 1024**2 + 2816**2) * 4
    assert shallow.gptq == hessians + 3 * 1024 * 2816 * 4 + 2 * 2816**2 * 4


def test_check_memory_names_the_parts_and_the_fixes() -> None:
    estimate = MemoryEstimate(weights=3 * GIB, outside_layers=GIB, activations=GIB // 2, gptq=0)
    check_memory(estimate, 5 * GIB, streaming=False)
    with pytest.raises(MsquantInputError) as error:
        check_memory(estimate, 4 * GIB, streaming=False)
    message = str(error.value)
    assert (
        "needs about 4.50 GiB (decoder layer weights 3.00 GiB, embeddings and head 1.00" in message
    )
    assert "more than --max_memory 4.00 GiB" in message
    assert "spec.runner: layer_wise" in message and "--max_calib_tokens" in message
    with pytest.raises(MsquantInputError) as streamed:
        check_memory(estimate, 4 * GIB, streaming=True)
    assert "layer_wise" not in str(streamed.value)


def test_quant_over_the_limit_stops_before_loading(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "w8a16", "--calib_path", CALIB_TXT, "--max_memory", "100kB",
        "--no_progress",
    )  # fmt: skip
    assert result.code == 2
    assert "msquant: error: the run needs about" in result.err
    assert "more than --max_memory 0.00 GiB" in result.err
    assert "Loading weights" not in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@NEEDS_MOE_TRANSFORMERS
def test_experts_per_pass_spreads_the_expert_hessians(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """The MoE experts' Hessians count once per calibration pass; the refusal of an MoE run
    names ``ext.experts_per_pass`` as a fix."""
    model_dir = tiny_model_factory("qwen3_moe", num_layers=2)
    meta = build_meta_model(load_model_config(model_dir))
    layers = find_decoder_layers(meta)

    def gptq_bytes(passes: int) -> int:
        return estimate_memory(
            meta, layers, 10**6, streaming=True, calibration_tokens=64, gptq=True,
            gptq_passes=passes,
        ).gptq  # fmt: skip

    # 8 experts x (gate, up: in 64; down: in 32), float32; three passes hold a third at a time
    experts = 8 * (2 * 64**2 + 32**2) * 4
    assert gptq_bytes(1) - gptq_bytes(3) == experts - -(-experts // 3)
    assert gptq_bytes(8) - gptq_bytes(3) == -(-experts // 8) - -(-experts // 3)
    estimate = estimate_memory(
        meta, layers, 10**6, streaming=True, calibration_tokens=64, gptq=True
    )
    assert estimate.experts
    with pytest.raises(MsquantInputError, match=r"ext\.experts_per_pass"):
        check_memory(estimate, 1, streaming=True)
