"""The regression gate: ``msquant quant --baseline_report OLD.json`` exits 3 with a diff when a
module's output error grew more than allowed, 0 otherwise; bad gate inputs are exit 2 up front."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CALIB_TXT, CliResult

from msquant import MsquantInputError, compare_reports
from msquant.report.document import strip_timings
from msquant.report.regression import parse_tolerance

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


# --- the perplexity gate ---------------------------------------------------------------------

EVAL_SEQLEN = 64
INT8 = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
INT4 = {"dtype": "int4", "scope": "per_channel", "symmetric": True, "method": "minmax"}


def _minmax_yaml(path: Path, weight: dict[str, Any]) -> Path:
    config = {"apiversion": "modelslim_v1", "spec": {"process": [
        {"type": "linear_quant", "qconfig": {"weight": weight}},
    ]}}  # fmt: skip
    path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 1,100 tokens of the tiny tokenizer: 18 windows of 64."""
    path = tmp_path_factory.mktemp("gate_text") / "text.txt"
    path.write_text(CALIB_TXT.read_text(encoding="utf-8")[:2500], encoding="utf-8")
    return path


def evaluated(ppl: float, **settings: Any) -> dict[str, Any]:
    """A report with an evaluation section (sha256 of nothing unless given)."""
    evaluation = {
        "data": "text.txt",
        "data_sha256": hashlib.sha256(b"").hexdigest(),
        "seqlen": 64,
        "stride": 64,
        "max_samples": None,
        "tokens": 1000,
        "ppl": ppl,
        **settings,
    }
    return report({"a": 0.01}, evaluation=evaluation)


def test_compare_flags_a_perplexity_increase_beyond_the_tolerance_only() -> None:
    base, now = evaluated(10.0), evaluated(10.06)
    within = compare_reports(base, now, None, 0.01)
    assert within.ok and within.ppl_compared and within.compared == 0
    assert within.notes == ["perplexity 10.06 vs baseline 10 (+0.60 %, allowed +1.00 %)"]
    tight = compare_reports(base, now, None, 0.005)
    assert tight.regressions == ["perplexity 10.06 vs baseline 10 (+0.60 %, allowed +0.50 %)"]
    assert "compared 0 module(s) and the perplexity with the baseline: 1 regression(s)" in (
        tight.render()
    )
    assert compare_reports(base, evaluated(9.0), None, 0.0).ok  # lower is never a regression
    both = compare_reports(base, evaluated(10.0, tokens=999), 0.0, 0.0)
    assert both.ok and both.compared == 1
    assert "different token counts" in "\n".join(both.notes)


@pytest.mark.parametrize(
    ("baseline", "message"),
    [
        (report({"a": 0.01}), "the baseline report has no perplexity (no 'evaluation' section)"),
        (evaluated(float("nan")), "has no valid perplexity"),
        (evaluated(10.0, data_sha256="0" * 64), "was evaluated on other data"),
        (evaluated(10.0, seqlen=32), "with seqlen 32, this run with 64"),
        (evaluated(10.0, stride=16), "pass --eval_stride 16"),
        (evaluated(10.0, max_samples=4), "pass --eval_max_samples 4"),
    ],
)
def test_incomparable_baselines_are_input_errors(baseline: dict[str, Any], message: str) -> None:
    with pytest.raises(MsquantInputError, match=re.escape(message)):
        compare_reports(baseline, evaluated(10.0), None, 0.01)


def test_the_perplexity_gate_needs_this_runs_evaluation() -> None:
    with pytest.raises(MsquantInputError, match="quantize with eval_data"):
        compare_reports(evaluated(10.0), report({"a": 0.01}), None, 0.01)
    # without the perplexity gate a missing evaluation does not matter
    assert compare_reports(evaluated(10.0), report({"a": 0.01}), 0.0).ok


def test_quant_perplexity_gate_exit_codes(
    tiny_llama: Path, tmp_path: Path, eval_text: Path, run_cli: Callable[..., CliResult]
) -> None:
    """An int8 baseline; an int4 run exits 3 under a tight limit and 0 under a loose one."""

    def quant(name: str, weight: dict[str, Any], *gate: str | Path) -> CliResult:
        return run_cli(
            "quant", "--model_path", tiny_llama, "--save_path", tmp_path / name,
            "--config_path", _minmax_yaml(tmp_path / f"{name}.yaml", weight), "--no_progress",
            "--eval_data", eval_text, "--eval_seqlen", EVAL_SEQLEN, *gate,
        )  # fmt: skip

    assert quant("int8", INT8).code == 0
    baseline_path = tmp_path / "int8" / "quant_report.json"
    baseline = json.loads(baseline_path.read_text(encoding="utf-8"))
    old = baseline["evaluation"]["ppl"]
    again = quant(
        "int8_again", INT8, "--baseline_report", baseline_path, "--max_ppl_increase", "0%"
    )
    assert again.code == 0, again.err
    rerun = json.loads((tmp_path / "int8_again" / "quant_report.json").read_text(encoding="utf-8"))
    assert strip_timings(rerun["evaluation"]) == strip_timings(
        baseline["evaluation"]
    )  # deterministic apart from timings

    tight = quant("int4", INT4, "--baseline_report", baseline_path, "--max_ppl_increase", "0.01%")
    assert tight.code == 3
    new = json.loads((tmp_path / "int4" / "quant_report.json").read_text(encoding="utf-8"))
    new_ppl = new["evaluation"]["ppl"]
    increase = new_ppl / old - 1
    assert 0.0001 < increase < 0.01  # int4 per-channel costs more than int8 on this model
    assert "compared 0 module(s) and the perplexity with the baseline: 1 regression(s)" in tight.err
    assert (
        f"REGRESSION perplexity {new_ppl:.6g} vs baseline {old:.6g} "
        f"(+{increase * 100:.2f} %, allowed +0.01 %)"
    ) in tight.err

    loose = quant("int4_ok", INT4, "--baseline_report", baseline_path, "--max_ppl_increase", "1%")
    assert loose.code == 0, loose.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max_ppl_increase", "1%"], "--max_ppl_increase needs --eval_data TEXT_FILE"),
        (["--eval_seqlen", "32"], "--eval_seqlen needs --eval_data"),
        (["--eval_max_samples", "3"], "--eval_max_samples needs --eval_data"),
        (
            ["--eval_data", "{text}", "--max_ppl_increase", "1%"],
            "--max_ppl_increase needs --baseline_report",
        ),
        (
            ["--eval_data", "{text}", "--baseline_report", "{plain}", "--max_ppl_increase", "1%"],
            "the baseline report has no perplexity (no 'evaluation' section): it was written by a "
            "run without --eval_data",
        ),
        (
            ["--eval_data", "{other}", "--baseline_report", "{evaluated}", "--max_ppl_increase",
             "1%"],
            "the baseline report was evaluated on other data",
        ),
        (
            ["--eval_data", "{text}", "--eval_seqlen", "32", "--baseline_report", "{evaluated}",
             "--max_ppl_increase", "1%"],
            "evaluated with seqlen 64, this run with 32: perplexities are only comparable on the "
            "same windows; pass --eval_seqlen 64",
        ),
        (
            ["--eval_data", "{text}", "--baseline_report", "{evaluated}", "--max_ppl_increase",
             "x"],
            "invalid tolerance 'x'",
        ),
        (["--eval_data", "{missing}"], "evaluation data file {missing} does not exist"),
        (
            ["--eval_data", "{text}", "--eval_seqlen", "1024"],
            "eval seqlen 1024 is longer than the model's max_position_embeddings (512)",
        ),
        (["--eval_data", "{text}", "--eval_stride", "600"], "stride must be between 1 and seqlen"),
    ],
)  # fmt: skip
def test_bad_perplexity_gate_inputs_exit_2_before_any_work(
    args: list[str],
    message: str,
    tiny_llama: Path,
    tmp_path: Path,
    eval_text: Path,
    run_cli: Callable[..., CliResult],
) -> None:
    other = tmp_path / "other.txt"
    other.write_text("Some other evaluation text.\n", encoding="utf-8")
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(report({"a": 0.01})), encoding="utf-8")
    sha = hashlib.sha256(eval_text.read_bytes()).hexdigest()
    with_eval = tmp_path / "evaluated.json"
    with_eval.write_text(json.dumps(evaluated(10.0, data_sha256=sha)), encoding="utf-8")
    names = {
        "text": eval_text,
        "other": other,
        "plain": plain,
        "evaluated": with_eval,
        "missing": tmp_path / "nope.txt",
    }
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "w8a16", "--no_progress", *(a.format(**names) for a in args),
    )  # fmt: skip
    assert result.code == 2, result.err
    assert message.format(**names) in result.err
    assert "Traceback" not in result.err
    assert not (tmp_path / "out").exists()
