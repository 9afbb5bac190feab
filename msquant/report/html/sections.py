"""The report page's run summary and its sortable table of modules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from msquant.report.html.content import PageLayer, PageModule
from msquant.report.html.text import esc, finite_number, fmt, mean, seconds_text

__all__ = ["TABLE_COLUMNS", "NUMERIC_COLUMNS", "summary_section", "table_section"]


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


def summary_section(
    report: Mapping[str, Any], modules: Sequence[PageModule], layers: Sequence[PageLayer]
) -> str:
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
    items = "".join(
        f'<dt>{esc(label)}</dt><dd data-key="{key}">{esc(value)}</dd>' for key, label, value in rows
    )
    return f'<section id="run-summary"><h2>Run</h2><dl id="summary">{items}</dl></section>'


def _cell(module: PageModule, key: str) -> str:
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
        data = "" if number is None else repr(number)
        return f'<td class="num" data-value="{data}">{esc(text)}</td>'
    return f'<td data-value="{esc(text)}">{esc(text)}</td>'


def table_section(modules: Sequence[PageModule]) -> str:
    """The sortable table of every module (``table#modules``)."""
    head = "".join(
        f'<th data-key="{key}" scope="col" tabindex="0">{esc(label)}</th>'
        for key, label in TABLE_COLUMNS
    )
    rows = "".join(
        f'<tr data-module="{esc(m.name)}">'
        + "".join(_cell(m, key) for key, _ in TABLE_COLUMNS)
        + "</tr>"
        for m in modules
    )
    if not modules:
        rows = (
            f'<tr class="empty"><td colspan="{len(TABLE_COLUMNS)}">no quantized modules</td></tr>'
        )
    return (
        '<section id="module-table"><h2>Modules</h2>'
        '<p class="hint">Click a header to sort (again to reverse).</p>'
        f'<table id="modules"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'
        "</section>"
    )
