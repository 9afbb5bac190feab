"""``msquant plan --max_memory``: the run's peak memory estimate beside the plan, refused as
``msquant quant --max_memory`` refuses it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from conftest import CALIB_TXT, CliResult

from msquant.load.calibration import read_calibration_texts, tokenize_samples
from msquant.load.model_folder import load_tokenizer

HIDDEN = 64  # the tiny Llama's width (float32)


def _tokens(model: Path, max_tokens: int | None = None) -> int:
    samples = tokenize_samples(read_calibration_texts(CALIB_TXT), load_tokenizer(model), max_tokens)
    return sum(int(s.numel()) for s in samples)


def test_plan_prints_the_estimate_and_its_breakdown(
    tiny_llama: Path, run_cli: Callable[..., CliResult]
) -> None:
    result = run_cli(
        "plan", "--model_path", tiny_llama, "--quant_type", "w8a8", "--max_memory", "64GiB",
        "--calib_path", CALIB_TXT,
    )  # fmt: skip
    assert result.code == 0, result.err
    assert "memory: the run needs about " in result.out and " MiB at model.layers.0" in result.out
    assert "at model.layers.0, fits in --max_memory 64.00 GiB" in result.out
    assert "iter_smooth: channel maxima" in result.out
    assert "linear_quant: minmax rounding (largest module)" in result.out
    assert "Hessian" not in result.out  # W8A8_DYNAMIC minmax keeps none


def test_plan_json_carries_the_estimate_of_the_calibration_tokens(
    tiny_llama: Path, run_cli: Callable[..., CliResult]
) -> None:
    """The estimate counts the calibration set the run would use, tokenized (here truncated to
    32 tokens a sample): the hidden states entering and leaving a layer, float32."""
    result = run_cli(
        "plan", "--model_path", tiny_llama, "--quant_type", "w8a8", "--max_memory", "1GiB",
        "--calib_path", CALIB_TXT, "--max_calib_tokens", "32", "--json",
    )  # fmt: skip
    assert result.code == 0, result.err
    memory = json.loads(result.out)["memory"]
    assert memory["limit_bytes"] == 2**30 and memory["layer"] == "model.layers.0"
    items = {item["what"]: item["bytes"] for item in memory["items"]}
    tokens = _tokens(tiny_llama, 32)
    assert items["calibration hidden states (in and out)"] == 2 * tokens * HIDDEN * 4
    assert memory["total_bytes"] == sum(items.values())


def test_plan_refuses_what_quant_refuses(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """Over the limit: exit 2 with quant's refusal, word for word, after the plan and the
    breakdown."""
    plan = run_cli(
        "plan", "--model_path", tiny_llama, "--quant_type", "w8a16", "--max_memory", "100kB",
        "--calib_path", CALIB_TXT,
    )  # fmt: skip
    assert plan.code == 2
    assert "does not fit in --max_memory 0.1 MiB" in plan.out
    assert "linear_quant: quantized weights" in plan.out
    quant = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "w8a16", "--calib_path", CALIB_TXT, "--max_memory", "100kB",
        "--no_progress",
    )  # fmt: skip
    assert quant.code == 2
    refusal = [line for line in plan.err.splitlines() if line.startswith("msquant: error:")]
    assert refusal and refusal[0] in quant.err
    assert "the run needs about" in refusal[0] and "more than --max_memory 0.1 MiB" in refusal[0]


def test_plan_refuses_a_memory_size_it_cannot_read(
    tiny_llama: Path, run_cli: Callable[..., CliResult]
) -> None:
    result = run_cli(
        "plan", "--model_path", tiny_llama, "--quant_type", "w8a16", "--max_memory", "lots"
    )
    assert result.code == 2
    assert "--max_memory 'lots' is not a memory size; write e.g. 64GiB" in result.err
    assert result.out == ""
