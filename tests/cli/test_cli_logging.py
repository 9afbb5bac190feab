"""The CLI logs to the current stderr, never prints on stdout, and keeps library code silent."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import EXAMPLES, CliResult


def test_log_lines_follow_stderr_replacement(
    run_cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert run_cli("validate", EXAMPLES / "w8a16_per_channel_minmax.yaml").code == 0
    replacement = io.StringIO()
    monkeypatch.setattr(sys, "stderr", replacement)
    logging.getLogger("msquant.test").warning("after the stream changed")
    assert "after the stream changed" in replacement.getvalue()


def test_quant_writes_nothing_on_stdout(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "w8a16", "--no_progress",
    )  # fmt: skip
    assert result.code == 0
    assert result.out == ""
    assert "quantized 14 linear layer(s) of llama" in result.err
