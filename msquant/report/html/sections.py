"""The data of the report page's run summary and its sortable table of modules (the markup is
in ``templates/summary.html.j2`` and ``templates/modules_table.html.j2``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msquant.report.html.content import PageLayer, PageModule
from msquant.report.html.text import finite_number, fmt, mean, seconds_text

__all__ = [
    "TABLE_COLUMNS",
    "NUMERIC_COLUMNS",
    "SummaryRow",
    "TableCell",
    "TableRow",
    "summary_rows",
    "kv_cache_text",
    "table_rows",
]


# Columns of the module table: key (for data-key and #sort=), header, how to render a value.
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "module"),
    ("layer", "layer"),
    ("type", "type"),
    ("method", "method"),
    ("bits", "bits"),
    ("group_size", "group"),
    ("symmetric", "sym"),
    ("gptq_loss", "GPTQ loss"),
    ("percdamp", "percdamp"),
    ("damp_retries", "retries"),
    ("dead_columns", "dead cols"),
    ("output_error", "output error"),
    ("rtn_output_error", "RTN error"),
    ("error_ratio", "error / RTN"),
    ("solve_seconds", "solve s"),
)
NUMERIC_COLUMNS = frozenset(key for key, _ in TABLE_COLUMNS[4:]) | {"layer"}


@dataclass(frozen=True)
class SummaryRow:
    """One ``dt``/``dd`` pair of the run summary; ``key`` is the ``dd``'s ``data-key``."""

    key: str
    label: str
    value: str


@dataclass(frozen=True)
class TableCell:
    """One cell of the module table: its text, and for numeric columns the ``data-value`` the
    sorting script reads (empty when the value is missing)."""

    text: str
    numeric: bool = False
    data: str = ""


@dataclass(frozen=True)
class TableRow:
    """One module's row (``tr[data-module=name]``)."""

    name: str
    cells: tuple[TableCell, ...]


def summary_rows(
    report: Mapping[str, Any], modules: Sequence[PageModule], layers: Sequence[PageLayer]
) -> list[SummaryRow]:
    """The run summary (``dl#summary``): model, hashes, calibration, totals, versions."""
    errors = mean(m.number("output_error") for m in modules)
    rtn = mean(m.number("rtn_output_error") for m in modules)
    retries = sum(int(m.number("damp_retries") or 0) for m in modules)
    rows: list[tuple[str, str, str]] = [
        ("model_path", "model", fmt(report.get("model_path"))),
        ("model_type", "model type", fmt(report.get("model_type"))),
        ("device", "device", fmt(report.get("device"))),
        ("config_sha256", "config sha256", fmt(report.get("config_sha256"))),
        ("calibration_sha256", "calibration sha256", fmt(report.get("calibration_sha256"))),
        (
            "calibration",
            "calibration",
            f"{fmt(report.get('calibration_samples'))} sample(s), "
            f"{fmt(report.get('calibration_tokens'))} token(s)",
        ),
        ("modules", "quantized modules", str(len(modules))),
        ("layers", "decoder layers", str(len(layers))),
        ("mean_output_error", "mean output error", fmt(errors)),
        ("mean_rtn_output_error", "mean round-to-nearest error", fmt(rtn)),
        ("damp_retries", "damping retries", str(retries)),
        ("capture_seconds", "calibration capture", seconds_text(report.get("capture_seconds"))),
        ("total_seconds", "total time", seconds_text(report.get("total_seconds"))),
    ]
    listed = report.get("kv_caches")
    caches = [c for c in listed if isinstance(c, Mapping)] if isinstance(listed, list) else []
    if caches:
        rows.append(("kv_caches", "quantized KV cache", kv_cache_text(caches)))
    evaluation = report.get("evaluation")
    if isinstance(evaluation, Mapping):
        rows.append(
            (
                "perplexity",
                "perplexity",
                f"{fmt(evaluation.get('ppl'), 6)} on {fmt(evaluation.get('data'))} "
                f"({fmt(evaluation.get('tokens'))} tokens, seqlen {fmt(evaluation.get('seqlen'))}"
                f", stride {fmt(evaluation.get('stride'))})",
            )
        )
    versions = ", ".join(
        f"{name} {fmt(report.get(f'{name}_version'))}"
        for name in ("msquant", "torch", "transformers", "python")
    )
    rows.append(("versions", "versions", versions))
    return [SummaryRow(key, label, value) for key, label, value in rows]


def kv_cache_text(caches: Sequence[Mapping[str, Any]]) -> str:
    """``C8 on 2 attention(s): model.layers.0.self_attn, ...; largest |key| 4.1, |value| 0.93``."""
    schemes = "/".join(sorted({fmt(c.get("scheme")) for c in caches}))
    names = [fmt(c.get("name")) for c in caches]
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}"
    keys = [k for c in caches if (k := finite_number(c.get("key_absmax"))) is not None]
    values = [v for c in caches if (v := finite_number(c.get("value_absmax"))) is not None]
    text = f"{schemes} on {len(caches)} attention(s): {shown}"
    if keys and values:
        text += f"; largest |key| {fmt(max(keys))}, |value| {fmt(max(values))}"
    return text


def _cell(module: PageModule, key: str) -> TableCell:
    """One table cell; numeric cells carry ``data-value`` for sorting (empty when missing)."""
    if key == "name":
        value: Any = module.name
    elif key == "layer":
        value = module.layer
    elif key == "type":
        value = module.type
    elif key == "error_ratio":
        value = module.ratio
    else:
        value = module.entry.get(key)
    if key == "group_size" and value is None and "group_size" in module.entry:
        text = "channel"
    elif key == "symmetric" and isinstance(value, bool):
        text = "yes" if value else "no"
    elif key == "solve_seconds":
        seconds = finite_number(value)
        text = "-" if seconds is None else f"{seconds:.2f}"
    else:
        text = fmt(value)
    if key in NUMERIC_COLUMNS:
        number = finite_number(value)
        return TableCell(text, numeric=True, data="" if number is None else repr(number))
    return TableCell(text)


def table_rows(modules: Sequence[PageModule]) -> list[TableRow]:
    """The rows of the table of every module (``table#modules``), one per module."""
    return [TableRow(m.name, tuple(_cell(m, key) for key, _ in TABLE_COLUMNS)) for m in modules]
