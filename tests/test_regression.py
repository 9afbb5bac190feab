"""The regression gate: ``msquant quant --baseline_report OLD.json`` exits 3 with a diff when a
module's output error grew more than allowed, 0 otherwise; bad gate inputs are exit 2 up front."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult

from msquant import MsquantInputError, compare_reports, parse_tolerance

GPTQ_YAML = """\
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {dtype: int4, scope: per_group, method: gptq, ext: {group_size: 32}}
"""


def report(errors: dict[str, float | None], **extra: Any) -> dict[str, Any]:
    modules = [{"name": name, "output_error": value} for name, value in errors.items()]
    return {"config_sha256": "a", "calibration_sha256": "b", "modules": modules, **extra}


@pytest.mark.parametrize(("text", "value"), [("5%", 0.05), ("0.05", 0.05), (" 0% ", 0.0)])
def test_tolerances_parse(text: str, value: float) -> None:
    assert parse_tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "-1%", "nan", "inf"])
def test_bad_tolerances_are_refused(text: str) -> None:
    with pytest.raises(MsquantInputError, match="invalid tolerance"):
        parse_tolerance(text)


def test_compare_flags_growth_beyond_the_tolerance_only() -> None:
    base = report({"a": 0.010, "b": 0.020, "c": None, "gone": 0.1})
    now = report({"a": 0.0104, "b": 0.0206, "c": None, "new": 0.3}, config_sha256="z")
    outcome = compare_reports(base, now, 0.05)
    assert not outcome.ok and outcome.compared == 2
    assert outcome.regressions == ["gone: quantized in the baseline, not in this run"]
    strict = compare_reports(base, now, 0.035)  # a grew 4 %, b 3 %
    flagged = [line.split(":")[0] for line in strict.regressions]
    assert flagged == ["a", "gone"]
    assert strict.regressions[0] == (
        "a: output error 0.0104 vs baseline 0.01 (+4.00 %, allowed +3.50 %)"
    )
    notes = "\n".join(outcome.notes)
    assert "config_sha256 differs" in notes and "c: no output error" in notes
    assert "1 module(s) quantized now but not in the baseline" in notes


def test_quant_against_its_own_baseline_passes_and_a_better_baseline_fails(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    config = tmp_path / "gptq.yaml"
    config.write_text(GPTQ_YAML)
    base = ["quant", "--model_path", tiny_llama, "--config_path", config, "--no_progress"]
    assert run_cli(*base, "--save_path", tmp_path / "first").code == 0
    baseline = tmp_path / "first" / "quant_report.json"
    same = run_cli(
        *base, "--save_path", tmp_path / "second", "--baseline_report", baseline,
        "--max_layer_error_increase", "0%",
    )  # fmt: skip
    assert same.code == 0, same.err
    # a baseline whose errors were 20 % lower: this run regressed on every module
    data = json.loads(baseline.read_text())
    for module in data["modules"]:
        module["output_error"] *= 0.8
    better = tmp_path / "better.json"
    better.write_text(json.dumps(data))
    worse = run_cli(*base, "--save_path", tmp_path / "third", "--baseline_report", better)
    assert worse.code == 3
    assert "regression against the baseline" in worse.err
    assert "14 regression(s)" in worse.err and "model.layers.0.self_attn.q_proj" in worse.err
    assert (tmp_path / "third" / "quant_report.json").is_file()  # the export is still written
    loose = run_cli(
        *base, "--save_path", tmp_path / "fourth", "--baseline_report", better,
        "--max_layer_error_increase", "30%",
    )  # fmt: skip
    assert loose.code == 0, loose.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--baseline_report", "missing.json"], "cannot read baseline report"),
        (["--baseline_report", "notjson.json"], "is not valid JSON"),
        (["--baseline_report", "list.json"], "is not a run report"),
        (
            ["--max_layer_error_increase", "5%"],
            "--max_layer_error_increase needs --baseline_report",
        ),
        (
            ["--baseline_report", "list.json", "--max_layer_error_increase", "x"],
            "invalid tolerance",
        ),
    ],
)
def test_bad_gate_inputs_exit_2_before_any_work(
    args: list[str],
    message: str,
    tiny_llama: Path,
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notjson.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "w8a16", "--no_progress", *args,
    )  # fmt: skip
    assert result.code == 2 and message in result.err
    assert not (tmp_path / "out").exists()
