"""Regression gate: compare a run's report with a baseline report (``--baseline_report``).

Scripted regression suites re-run the same quantization over time and must fail when a run got
worse. Two gates, each with a relative tolerance:

- per module (``max_layer_error_increase``): the relative output error on the calibration
  activations (``output_error`` in ``quant_report.json``) may grow by at most the tolerance. A
  module of the baseline missing from the run is a regression too (it would silently be left in
  float or renamed). A different config or calibration hash is reported but is not a failure by
  itself: the point of a suite may be to change exactly those and check the errors did not grow.
- model level (``max_ppl_increase``): the perplexity in the report's ``evaluation`` section
  (``quant --eval_data``) may grow by at most the tolerance. Perplexities are only comparable on
  the same tokens, so both reports must have been evaluated on the same file (sha256), window
  length, stride and window limit; anything else is an input error, not a regression.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msquant.errors import MsquantInputError
from msquant.report.document import load_report

__all__ = [
    "EXIT_REGRESSION",
    "EVALUATION_SETTINGS",
    "RegressionResult",
    "check_ppl_baseline",
    "compare_reports",
    "load_baseline_report",
    "parse_tolerance",
]

#: Exit code of ``msquant quant`` when the run is worse than its baseline.
EXIT_REGRESSION = 3
#: Errors below this are treated as equal (float noise on near-lossless layers).
ABSOLUTE_SLACK = 1e-9
#: Relative perplexity changes below this are treated as none (summation-order noise).
PPL_SLACK = 1e-12
#: Keys of the report's ``evaluation`` that must match for perplexities to be comparable, with
#: the ``msquant quant`` option that sets each.
EVALUATION_SETTINGS = {
    "data_sha256": "--eval_data",
    "seqlen": "--eval_seqlen",
    "stride": "--eval_stride",
    "max_samples": "--eval_max_samples",
}


@dataclass
class RegressionResult:
    """Outcome of a comparison: ``regressions`` fail the gate, ``notes`` only inform."""

    regressions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: int = 0
    ppl_compared: bool = False

    @property
    def ok(self) -> bool:
        """True when no module got worse than allowed."""
        return not self.regressions

    def render(self) -> str:
        """A readable summary: one line per regression and note."""
        what = f"{self.compared} module(s)" + (" and the perplexity" if self.ppl_compared else "")
        head = f"compared {what} with the baseline: " + (
            "no regression" if self.ok else f"{len(self.regressions)} regression(s)"
        )
        lines = [head]
        lines += [f"  REGRESSION {line}" for line in self.regressions]
        lines += [f"  note: {line}" for line in self.notes]
        return "\n".join(lines)


def parse_tolerance(text: str) -> float:
    """``"5%"`` -> 0.05, ``"0.05"`` -> 0.05; must be a finite number >= 0.

    :raises MsquantInputError: for anything else.
    """
    raw = text.strip()
    scale = 100.0 if raw.endswith("%") else 1.0
    try:
        value = float(raw.removesuffix("%")) / scale
    except ValueError:
        raise MsquantInputError(
            f"invalid tolerance {text!r}: give a relative increase such as 5% or 0.05"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise MsquantInputError(f"invalid tolerance {text!r}: it must be a number >= 0")
    return value


def load_baseline_report(path: str | Path) -> dict[str, Any]:
    """Read a ``quant_report.json`` written by an earlier run.

    :raises MsquantInputError: when the file is missing, not JSON, or not a run report.
    """
    return load_report(path, role="baseline report")


def _errors_by_module(report: Mapping[str, Any]) -> dict[str, float | None]:
    errors: dict[str, float | None] = {}
    for entry in report.get("modules", []):
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            value = entry.get("output_error")
            errors[entry["name"]] = float(value) if isinstance(value, (int, float)) else None
    return errors


def compare_reports(
    baseline: Mapping[str, Any],
    current: Mapping[str, Any],
    max_layer_error_increase: float | None,
    max_ppl_increase: float | None = None,
) -> RegressionResult:
    """Compare a run's report with a baseline: ``current <= baseline * (1 + tolerance)`` must
    hold for each module's output error and for the perplexity, each gate when its tolerance is
    given.

    :param max_layer_error_increase: allowed relative increase per module (0.05 = 5 %); None
        skips the per-module gate.
    :param max_ppl_increase: allowed relative perplexity increase; None skips the perplexity
        gate. Both reports need an ``evaluation`` with the same settings.
    :raises MsquantInputError: when the perplexity gate is asked for and either report has no
        evaluation, or they were evaluated differently (see :func:`check_ppl_baseline`).
    """
    result = RegressionResult()
    for key in ("config_sha256", "calibration_sha256"):
        if baseline.get(key) != current.get(key):
            result.notes.append(f"{key} differs from the baseline's")
    if max_layer_error_increase is not None:
        _compare_modules(baseline, current, max_layer_error_increase, result)
    if max_ppl_increase is not None:
        _compare_perplexity(baseline, current, max_ppl_increase, result)
    return result


def _compare_modules(
    baseline: Mapping[str, Any],
    current: Mapping[str, Any],
    max_layer_error_increase: float,
    result: RegressionResult,
) -> None:
    """The per-module gate: regressions and notes are added to ``result``."""
    old, new = _errors_by_module(baseline), _errors_by_module(current)
    for name, before in old.items():
        if name not in new:
            result.regressions.append(f"{name}: quantized in the baseline, not in this run")
            continue
        after = new[name]
        if before is None or after is None:
            result.notes.append(f"{name}: no output error to compare (data-free method)")
            continue
        result.compared += 1
        limit = before * (1.0 + max_layer_error_increase) + ABSOLUTE_SLACK
        if after > limit:
            increase = (after / before - 1.0) * 100 if before > 0 else math.inf
            result.regressions.append(
                f"{name}: output error {after:.6g} vs baseline {before:.6g} "
                f"(+{increase:.2f} %, allowed +{max_layer_error_increase * 100:.2f} %)"
            )
    extra = sorted(set(new) - set(old))
    if extra:
        result.notes.append(f"{len(extra)} module(s) quantized now but not in the baseline")


def _compare_perplexity(
    baseline: Mapping[str, Any],
    current: Mapping[str, Any],
    max_ppl_increase: float,
    result: RegressionResult,
) -> None:
    """The perplexity gate: one regression or one note with both values is added to ``result``."""
    evaluation = current.get("evaluation")
    if not isinstance(evaluation, Mapping):
        raise MsquantInputError(
            "the perplexity gate needs this run's perplexity: quantize with eval_data "
            "(--eval_data TEXT_FILE)"
        )
    check_ppl_baseline(baseline, evaluation)
    before = float(_evaluation_of(baseline)["ppl"])
    after = float(evaluation["ppl"])
    increase = after / before - 1.0
    line = (
        f"perplexity {after:.6g} vs baseline {before:.6g} "
        f"({increase * 100:+.2f} %, allowed +{max_ppl_increase * 100:.2f} %)"
    )
    result.ppl_compared = True
    if increase > max_ppl_increase + PPL_SLACK:
        result.regressions.append(line)
    else:
        result.notes.append(line)
    if _evaluation_of(baseline).get("tokens") != evaluation.get("tokens"):
        result.notes.append(
            "the perplexities were measured on different token counts (another tokenizer?)"
        )


def _evaluation_of(baseline: Mapping[str, Any]) -> Mapping[str, Any]:
    """The baseline's ``evaluation`` section (checked by :func:`check_ppl_baseline`)."""
    evaluation = baseline.get("evaluation")
    assert isinstance(evaluation, Mapping)
    return evaluation


def check_ppl_baseline(baseline: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Check that the baseline's perplexity is comparable with one measured with ``settings``.

    Called before a run starts (with :meth:`msquant.evaluate.EvaluationData.settings`) so a gate
    that cannot work fails before any work, and again when comparing (with the run's
    ``evaluation``).

    :param settings: ``data_sha256``, ``seqlen``, ``stride``, ``max_samples`` of this run.
    :raises MsquantInputError: when the baseline has no usable evaluation or differs in a setting,
        saying which option to change.
    """
    evaluation = baseline.get("evaluation")
    if not isinstance(evaluation, Mapping):
        raise MsquantInputError(
            "the baseline report has no perplexity (no 'evaluation' section): it was written by "
            "a run without --eval_data; re-run the baseline with --eval_data TEXT_FILE (same "
            "--eval_seqlen) or drop --max_ppl_increase"
        )
    ppl = evaluation.get("ppl")
    if not isinstance(ppl, (int, float)) or not math.isfinite(ppl) or ppl <= 0:
        raise MsquantInputError(
            f"the baseline report's evaluation has no valid perplexity (ppl = {ppl!r}); "
            "re-run the baseline with --eval_data"
        )
    for key, option in EVALUATION_SETTINGS.items():
        before, now = evaluation.get(key), settings.get(key)
        if before == now:
            continue
        if key == "data_sha256":
            raise MsquantInputError(
                f"the baseline report was evaluated on other data ({evaluation.get('data')}, "
                f"sha256 {str(before)[:12]}...) than this run ({settings.get('data', 'eval data')}"
                f", sha256 {str(now)[:12]}...); pass the same file as --eval_data, or re-run "
                "the baseline on this one"
            )
        hint = f"pass {option} {before}" if before is not None else f"drop {option}"
        raise MsquantInputError(
            f"the baseline report was evaluated with {key} {before}, this run with {now}: "
            f"perplexities are only comparable on the same windows; {hint}"
        )
