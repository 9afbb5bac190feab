"""--max_memory: the peak estimate made before weights load, and the early refusal."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS, CliResult
from transformers import AutoConfig

import msquant
from msquant import MsquantInputError
from msquant.config.processors import build_processors
from msquant.config.resolve import resolve_config
from msquant.contracts.registry import default_registry
from msquant.load.model_folder import build_meta_model, load_model_config
from msquant.model.layers import find_decoder_layers
from msquant.plugin import CalibrationSize, Processor
from msquant.run.memory_estimate import (
    GIB,
    MemoryEstimate,
    check_memory,
    estimate_memory,
    parse_memory,
)

PRACTICES = Path(msquant.__file__).parent / "data" / "practices"


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


GPTQ = {
    "apiversion": "modelslim_v1",
    "spec": {
        "process": [
            {
                "type": "linear_quant",
                "qconfig": {
                    "weight": {
                        "scope": "per_channel", "dtype": "int8", "symmetric": True,
                        "method": "gptq",
                    }
                },
            }
        ]
    },
}  # fmt: skip
#: 16 samples of 256 tokens, float32 activations, batches of 4096 tokens
CALIBRATION = CalibrationSize(tokens=4096, longest=256, batch_tokens=4096, dtype_bytes=4)


def _processors(config: dict[str, Any] | Path) -> list[Processor]:
    registry = default_registry()
    return build_processors(resolve_config(config, registry).config, registry)


def _estimate(layers: int, streaming: bool) -> MemoryEstimate:
    config = AutoConfig.for_model(
        "llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
    )  # fmt: skip
    meta = build_meta_model(config)
    params = sum(p.numel() for p in meta.parameters())
    return estimate_memory(
        meta, find_decoder_layers(meta), params * 2, _processors(GPTQ),  # a bfloat16 checkpoint
        streaming=streaming, calibration=CALIBRATION,
    )  # fmt: skip


def test_streamed_estimate_does_not_grow_with_depth() -> None:
    """A hand count of a GPTQ run on a 1024-wide Llama (float32 meta model, bfloat16 checkpoint):
    one layer streamed, or all of them loaded."""
    shallow, deep = _estimate(4, streaming=True), _estimate(16, streaming=True)
    assert deep.total == shallow.total
    whole_shallow, whole_deep = _estimate(4, streaming=False), _estimate(16, streaming=False)
    assert whole_deep.get("decoder layer weights") == 4 * whole_shallow.get("decoder layer weights")
    linears = [(1024, 1024)] * 4 + [(2816, 1024)] * 2 + [(1024, 2816)]  # (out, in)
    layer_bf16 = (sum(o * i for o, i in linears) + 2 * 1024) * 2  # + the two norms
    assert whole_shallow.get("decoder layer weights") == 4 * layer_bf16
    # float32 sum + staging buffer of 2048 rows (32 MiB / (4 * in) rows, at most 2048)
    hessian_1024 = 4 * 1024 * (1024 + 2048)
    hessian_2816 = 4 * 2816 * (2816 + 2048)
    assert shallow.items == (
        ("decoder layer weights", layer_bf16),
        ("embeddings and head", (2 * 1000 * 1024 + 1024) * 2),
        ("calibration hidden states (in and out)", 2 * 4096 * 1024 * 4),
        (
            "layer call arguments (attention masks, rotary tables)",
            (4096 * 256 + 2 * 4096 * 128) * 4,
        ),
        ("layer forward (one batch)", 3 * 4096 * 2816 * 4),
        ("linear_quant: quantized weights", sum(o * i + 8 * o for o, i in linears)),
        # q/k/v share one Hessian, gate/up another; o_proj and down_proj their own
        ("linear_quant: gptq Hessians (busiest pass)", 3 * hessian_1024 + hessian_2816),
        # down_proj: 11 float32 copies of the weight for the report's output errors
        ("linear_quant: gptq solve and output errors (largest module)", 11 * 2816 * 1024 * 4),
    )
    assert shallow.layer == "model.layers.0" and shallow.streamed and not whole_shallow.streamed


def test_a_smoothed_w8a8_run_charges_no_hessians() -> None:
    """The regression of issue 24: a calibrating processor (iter_smooth) no longer makes the
    estimate count GPTQ Hessians for a method that keeps none (W8A8_DYNAMIC minmax)."""
    config = AutoConfig.for_model(
        "llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=1000,
    )  # fmt: skip
    meta = build_meta_model(config)
    processors = _processors(PRACTICES / "w8a8.yaml")
    estimate = estimate_memory(
        meta, find_decoder_layers(meta), 10**6, processors, streaming=True,
        calibration=CALIBRATION,
    )  # fmt: skip
    labels = [label for label, _ in estimate.items]
    assert not [label for label in labels if "Hessian" in label]
    assert "linear_quant: minmax rounding (largest module)" in labels
    # iter_smooth's channel maxima (q_proj, gate_proj, o_proj, down_proj inputs, float32)
    assert estimate.get("iter_smooth: channel maxima") == (1024 + 1024 + 1024 + 2816) * 4


def test_check_memory_names_the_parts_and_the_fixes() -> None:
    items = (("decoder layer weights", 3 * GIB), ("embeddings and head", GIB),
             ("calibration hidden states (in and out)", GIB // 2))  # fmt: skip
    estimate = MemoryEstimate(items, "model.layers.0", streamed=False)
    check_memory(estimate, 5 * GIB)
    with pytest.raises(MsquantInputError) as error:
        check_memory(estimate, 4 * GIB)
    message = str(error.value)
    assert (
        "needs about 4.50 GiB (decoder layer weights 3.00 GiB, embeddings and head 1.00" in message
    )
    assert "more than --max_memory 4.00 GiB" in message
    assert "spec.runner: layer_wise" in message and "--max_calib_tokens" in message
    with pytest.raises(MsquantInputError) as streamed:
        check_memory(MemoryEstimate(items, "model.layers.0", streamed=True), 4 * GIB)
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
    assert "more than --max_memory 0.1 MiB" in result.err
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

    def hessian_bytes(passes: int | None) -> int:
        config = copy.deepcopy(GPTQ)
        if passes is not None:
            weight = config["spec"]["process"][0]["qconfig"]["weight"]
            weight["ext"] = {"experts_per_pass": passes}
        estimate = estimate_memory(
            meta, layers, 10**6, _processors(config), streaming=True, calibration=CALIBRATION
        )
        return estimate.get("linear_quant: gptq Hessians (busiest pass)")

    # 8 experts x (gate and up sharing one, in 64; down, in 32), float32 sums + 2048-row buffers
    expert = 4 * 64 * (64 + 2048) + 4 * 32 * (32 + 2048)
    attention = 2 * 4 * 64 * (64 + 2048)  # q/k/v share one (in 64); o_proj (in 64)
    assert hessian_bytes(None) == attention + 8 * expert
    assert hessian_bytes(3) == attention + 3 * expert  # the first pass: experts 0-2
    assert hessian_bytes(8) == hessian_bytes(None)
    estimate = estimate_memory(
        meta, layers, 10**6, _processors(GPTQ), streaming=True, calibration=CALIBRATION
    )
    assert estimate.experts
    with pytest.raises(MsquantInputError, match=r"ext\.experts_per_pass"):
        check_memory(estimate, 1)
