"""Reading a ``quant_report.json`` document back (``msquant report``, the regression gate), and
comparing two without their timings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from msquant.errors import MsquantInputError
from msquant.report.run_report import EvaluationReport, LayerTiming, ModuleReport, RunReport

__all__ = ["load_report", "mapping_entries", "report_from_dict", "strip_timings"]


def load_report(path: str | Path, role: str = "report") -> dict[str, Any]:
    """Read a ``quant_report.json`` document.

    :param role: what the file is, in messages (``"baseline report"`` for the regression gate).
    :raises MsquantInputError: when the file is missing, not JSON, or not a run report.
    """
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise MsquantInputError(f"cannot read {role} {file}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise MsquantInputError(f"{role} {file} is not UTF-8 text ({exc.reason})") from None
    except ValueError as exc:
        raise MsquantInputError(f"{role} {file} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("modules"), list):
        raise MsquantInputError(
            f"{file} is not a run report: expected quant_report.json with a 'modules' list"
        )
    return data


def report_from_dict(data: Mapping[str, Any]) -> RunReport:
    """A :class:`RunReport` from its JSON document (for :func:`msquant.render_report`).

    Unknown keys are ignored and missing ones keep their defaults, so documents of other msquant
    versions load; entries that are not objects are skipped.
    """
    report = RunReport(
        **_known_fields(RunReport, data, exclude={"modules", "layers", "evaluation"})
    )
    for entry in mapping_entries(data.get("modules")):
        if isinstance(entry.get("name"), str):
            report.add_module(ModuleReport(**_known_fields(ModuleReport, entry)))
    for entry in mapping_entries(data.get("layers")):
        if "index" in entry and "name" in entry:
            report.add_layer(LayerTiming(**_known_fields(LayerTiming, entry)))
    evaluation = data.get("evaluation")
    if isinstance(evaluation, Mapping):
        names = {f.name for f in fields(EvaluationReport)}
        if names <= set(evaluation):
            report.evaluation = EvaluationReport(**_known_fields(EvaluationReport, evaluation))
    return report


def _known_fields(
    cls: type, data: Mapping[str, Any], exclude: Iterable[str] = ()
) -> dict[str, Any]:
    names = {f.name for f in fields(cls)} - set(exclude)
    return {key: value for key, value in data.items() if key in names}


def mapping_entries(value: Any) -> list[Mapping[str, Any]]:
    """The entries of a JSON list that are objects (anything else: none)."""
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def strip_timings(data: Any) -> Any:
    """A copy of a report document without the keys ending in ``seconds`` (at any depth)."""
    if isinstance(data, dict):
        return {k: strip_timings(v) for k, v in data.items() if not k.endswith("seconds")}
    if isinstance(data, list):
        return [strip_timings(v) for v in data]
    return data
