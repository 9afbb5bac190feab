"""Reading a ``quant_report.json`` document back (``msquant report``, the regression gate), and
comparing two without their timings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from msquant.errors import MsquantInputError
from msquant.report.run_report import EvaluationReport, LayerTiming, ModuleReport, RunReport

__all__ = ["load_report", "mapping_entries", "report_from_dict", "strip_timings"]

T = TypeVar("T")


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
    versions load; run-wide values of the wrong type are left at their defaults, and module,
    layer and evaluation entries that are not valid records (not objects, a required field
    missing or of the wrong type) are skipped.
    """
    run_wide = _known_fields(RunReport, data, exclude={"modules", "layers", "evaluation"})
    report = _record(RunReport, run_wide, drop_invalid=True)
    assert report is not None  # every run-wide field has a default
    for entry in mapping_entries(data.get("modules")):
        if (module := _record(ModuleReport, _known_fields(ModuleReport, entry))) is not None:
            report.add_module(module)
    for entry in mapping_entries(data.get("layers")):
        if (layer := _record(LayerTiming, _known_fields(LayerTiming, entry))) is not None:
            report.add_layer(layer)
    evaluation = data.get("evaluation")
    if isinstance(evaluation, Mapping):
        report.evaluation = _record(EvaluationReport, _known_fields(EvaluationReport, evaluation))
    return report


def _record(cls: type[T], values: dict[str, Any], drop_invalid: bool = False) -> T | None:
    """``cls(**values)`` (a pydantic dataclass, so the values are validated); on invalid values
    None, or with ``drop_invalid`` the record without them (their defaults instead)."""
    try:
        return cls(**values)
    except (ValidationError, TypeError) as exc:
        if not drop_invalid or not isinstance(exc, ValidationError):
            return None
        invalid = {error["loc"][0] for error in exc.errors() if error["loc"]}
        return cls(**{key: value for key, value in values.items() if key not in invalid})


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
