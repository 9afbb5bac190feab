"""Regression gate: compare a run's report with a baseline report (``--baseline_report``).

Scripted regression suites re-run the same quantization over time and must fail when a run got
worse. The comparison is per module: the relative output error on the calibration activations
(``output_error`` in ``quant_report.json``) may grow by at most a relative tolerance. A module
of the baseline missing from the run is a regression too (it would silently be left in float or
renamed). A different config or calibration hash is reported but is not a failure by itself: the
point of a suite may be to change exactly those and check the errors did not grow.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msquant.errors import MsquantInputError

__all__ = [
    "EXIT_REGRESSION",
    "RegressionResult",
    "compare_reports",
    "load_baseline_report",
    "parse_tolerance",
]

#: Exit code of ``msquant quant`` when the run is worse than its baseline.
EXIT_REGRESSION = 3
#: Errors below this are treated as equal (float noise on near-lossless layers).
ABSOLUTE_SLACK = 1e-9


@dataclass
class RegressionResult:
    """Outcome of a comparison: ``regressions`` fail the gate, ``notes`` only inform."""

    regressions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    compared: int = 0

    @property
    def ok(self) -> bool:
        """True when no module got worse than allowed."""
        return not self.regressions

    def render(self) -> str:
        """A readable summary: one line per regression and note."""
        head = f"compared {self.compared} module(s) with the baseline: " + (
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
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise MsquantInputError(f"cannot read baseline report {file}: {exc.strerror}") from None
    except ValueError as exc:
        raise MsquantInputError(f"baseline report {file} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("modules"), list):
        raise MsquantInputError(
            f"{file} is not a run report: expected quant_report.json with a 'modules' list"
        )
    return data


def _errors_by_module(report: Mapping[str, Any]) -> dict[str, float | None]:
    errors: dict[str, float | None] = {}
    for entry in report.get("modules", []):
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            value = entry.get("output_error")
            errors[entry["name"]] = float(value) if isinstance(value, (int, float)) else None
    return errors


def compare_reports(
    baseline: Mapping[str, Any], current: Mapping[str, Any], max_layer_error_increase: float
) -> RegressionResult:
    """Compare per-module output errors: ``current <= baseline * (1 + tolerance)`` must hold.

    :param max_layer_error_increase: allowed relative increase (0.05 = 5 %).
    """
    result = RegressionResult()
    for key in ("config_sha256", "calibration_sha256"):
        if baseline.get(key) != current.get(key):
            result.notes.append(f"{key} differs from the baseline's")
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
    return result
