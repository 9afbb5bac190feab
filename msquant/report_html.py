"""``msquant report REPORT.json --html OUT.html``: the run report as a self-contained HTML page.

The page shows what ``quant_report.json`` holds where people would rather look than read: the run
summary, each module's relative output error next to round-to-nearest's (by decoder layer, and by
module type), the damping GPTQ used and the time per layer, and a table of every module.

Design choices:

- Charts are inline SVG generated here, so the page renders without JavaScript and without any
  network access (a Content-Security-Policy forbids every fetch); a few lines of inline JavaScript
  only make the module table sortable (click a header, or open the page with ``#sort=KEY`` /
  ``#sort=-KEY`` for descending).
- Elements carry stable ids, classes and ``data-*`` attributes (``svg#layer-errors
  rect.bar[data-module="..."]``, ``table#modules tr[data-module="..."]``, ...) so tests and
  scripts can find them.
- Every text taken from the report is HTML-escaped; the report may come from anywhere.
- :func:`render_html` is a pure function of the report document: the same report gives the same
  page, byte for byte. Missing or malformed fields render as ``-`` instead of failing, so reports
  of older or newer msquant versions still render.
"""

from __future__ import annotations

import html
import json
import logging
import math
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from msquant.errors import MsquantInputError
from msquant.report import EvaluationReport, LayerTiming, ModuleReport, RunReport

__all__ = [
    "load_report",
    "render_html",
    "report_from_dict",
    "write_html",
]

logger = logging.getLogger(__name__)

#: Colors of the usual decoder linear layers; other module types get one of ``EXTRA_COLORS``.
TYPE_COLORS = {
    "q_proj": "#4e79a7",
    "k_proj": "#76b7b2",
    "v_proj": "#59a14f",
    "o_proj": "#edc948",
    "gate_proj": "#b07aa1",
    "up_proj": "#ff9da7",
    "down_proj": "#e15759",
}
EXTRA_COLORS = ("#9c755f", "#f28e2b", "#bab0ac", "#8cd17d", "#86bcb6", "#d37295")
OTHER_LAYER = "other"  # group of modules outside every decoder layer (e.g. lm_head)

CHART_WIDTH = 1100
CHART_HEIGHT = 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 12, 16, 44
GROUP_GAP = 0.6  # gap between groups, in bar widths
MAX_AXIS_LABELS = 40

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


# --- reading -----------------------------------------------------------------------------------


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
    report = RunReport(**_known(RunReport, data, exclude={"modules", "layers", "evaluation"}))
    for entry in _mappings(data.get("modules")):
        if isinstance(entry.get("name"), str):
            report.add_module(ModuleReport(**_known(ModuleReport, entry)))
    for entry in _mappings(data.get("layers")):
        if "index" in entry and "name" in entry:
            report.add_layer(LayerTiming(**_known(LayerTiming, entry)))
    evaluation = data.get("evaluation")
    if isinstance(evaluation, Mapping):
        names = {f.name for f in fields(EvaluationReport)}
        if names <= set(evaluation):
            report.evaluation = EvaluationReport(**_known(EvaluationReport, evaluation))
    return report


def _known(cls: type, data: Mapping[str, Any], exclude: Iterable[str] = ()) -> dict[str, Any]:
    names = {f.name for f in fields(cls)} - set(exclude)
    return {key: value for key, value in data.items() if key in names}


def _mappings(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


# --- the model of the page ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Module:
    """One module row as the page shows it (values already validated)."""

    name: str
    layer: int | None  # decoder layer index; None outside every layer
    type: str  # last component of the name: q_proj, down_proj, ...
    entry: Mapping[str, Any]

    def number(self, key: str) -> float | None:
        """A finite numeric field, else None."""
        return _number(self.entry.get(key))

    @property
    def ratio(self) -> float | None:
        """``output_error / rtn_output_error`` (below 1: GPTQ did better than rounding)."""
        error, rtn = self.number("output_error"), self.number("rtn_output_error")
        if error is None or rtn is None or rtn <= 0:
            return None
        return error / rtn


@dataclass(frozen=True)
class _Layer:
    index: int
    name: str
    seconds: float | None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _layers(report: Mapping[str, Any]) -> list[_Layer]:
    layers = []
    for entry in _mappings(report.get("layers")):
        index, name = entry.get("index"), entry.get("name")
        if isinstance(index, int) and not isinstance(index, bool) and isinstance(name, str):
            layers.append(_Layer(index, name, _number(entry.get("seconds"))))
    return layers


LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _modules(report: Mapping[str, Any], layers: Sequence[_Layer]) -> list[_Module]:
    """The modules, each placed in the decoder layer whose name prefixes it (or by the first
    ``.N.`` in its name when the report lists no layers)."""
    prefixes = sorted(
        ((layer.name + ".", layer.index) for layer in layers), key=lambda p: -len(p[0])
    )
    modules = []
    for entry in _mappings(report.get("modules")):
        name = entry.get("name")
        if not isinstance(name, str):
            continue
        layer = next((index for prefix, index in prefixes if name.startswith(prefix)), None)
        if layer is None and not layers:
            match = LAYER_INDEX.search(name)
            layer = int(match.group(1)) if match else None
        modules.append(_Module(name, layer, name.rpartition(".")[2], entry))
    return modules


def _type_colors(modules: Sequence[_Module]) -> dict[str, str]:
    """A color per module type: fixed for the usual ones, then the extra palette in order."""
    colors: dict[str, str] = {}
    extra = 0
    for module in modules:
        if module.type in colors:
            continue
        if module.type in TYPE_COLORS:
            colors[module.type] = TYPE_COLORS[module.type]
        else:
            colors[module.type] = EXTRA_COLORS[extra % len(EXTRA_COLORS)]
            extra += 1
    return colors


# --- formatting --------------------------------------------------------------------------------


def _e(value: Any) -> str:
    """HTML-escaped text of any value (quotes too: safe in attributes)."""
    return html.escape(str(value), quote=True)


def _fmt(value: Any, digits: int = 4) -> str:
    number = _number(value)
    if number is None:
        return "-" if value is None or isinstance(value, float) else str(value)
    if isinstance(value, int):
        return str(value)
    return f"{number:.{digits}g}"


def _seconds(value: Any) -> str:
    number = _number(value)
    return "-" if number is None else f"{number:.2f} s"


def _mean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _nice_max(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above ``value`` (axis top)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if value <= step * power * (1 + 1e-12):
            return step * power
    return 10 * power


# --- charts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Bar:
    """One bar slot of a grouped chart."""

    module: _Module
    value: float | None
    reference: float | None  # the round-to-nearest value, drawn as a dashed outline
    label: str | None = None  # drawn above the bar (damping retries)


@dataclass(frozen=True)
class _Group:
    label: str
    key: str  # data-group value
    bars: list[_Bar]


@dataclass(frozen=True)
class _Axes:
    """Titles and size of one chart."""

    chart_id: str
    title: str
    x_label: str
    y_label: str
    height: int = CHART_HEIGHT


def _svg_head(axes: _Axes) -> str:
    return (
        f'<svg id="{axes.chart_id}" class="chart" role="img" aria-label="{_e(axes.title)}" '
        f'viewBox="0 0 {CHART_WIDTH} {axes.height}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{_e(axes.title)}</title>"
    )


def _svg_empty(axes: _Axes, text: str) -> str:
    """A chart without data: its frame and one ``text.empty`` line saying why."""
    return (
        _svg_head(axes) + f'<text class="empty" x="{CHART_WIDTH / 2}" y="{axes.height / 2}" '
        f'text-anchor="middle">{_e(text)}</text></svg>'
    )


def _x_title(axes: _Axes) -> str:
    x = MARGIN_LEFT + (CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT) / 2
    return (
        f'<text class="axis-label" x="{x:.2f}" y="{axes.height - 8}" text-anchor="middle">'
        f"{_e(axes.x_label)}</text>"
    )


def _grouped_chart(
    axes: _Axes,
    groups: Sequence[_Group],
    colors: Mapping[str, str],
    value_text: Callable[[_Bar], str],
    empty_text: str,
) -> str:
    """An inline SVG of bars grouped along x (layers or module types), one bar per module.

    Each bar is ``rect.bar`` (filled with its module type's color) and, when the bar has a
    reference value, ``rect.ref`` drawn as a dashed outline at the reference's height behind it.
    """
    bars = [bar for group in groups for bar in group.bars]
    values = [v for bar in bars for v in (bar.value, bar.reference) if v is not None]
    if not values:
        return _svg_empty(axes, empty_text)
    top = _nice_max(max(values))
    plot_w = CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = axes.height - MARGIN_TOP - MARGIN_BOTTOM
    slots = len(bars) + GROUP_GAP * (len(groups) + 1)
    width = plot_w / slots
    parts = [_svg_head(axes), _y_axis(top, plot_h, axes.y_label), _x_title(axes)]
    label_every = max(1, math.ceil(len(groups) / MAX_AXIS_LABELS))
    x = MARGIN_LEFT + GROUP_GAP * width
    for number, group in enumerate(groups):
        start = x
        parts.append(f'<g class="group" data-group="{_e(group.key)}">')
        for bar in group.bars:
            parts.append(_bar(bar, x, width, top, plot_h, colors, value_text))
            x += width
        # keep a label near the right edge inside the chart (about 6.5 px per character)
        center = min((start + x) / 2, CHART_WIDTH - 2 - 3.3 * len(group.label))
        if number % label_every == 0:
            parts.append(
                f'<text class="group-label" x="{center:.2f}" y="{axes.height - MARGIN_BOTTOM + 16}" '
                f'text-anchor="middle">{_e(group.label)}</text>'
            )
        parts.append("</g>")
        x += GROUP_GAP * width
    parts.append("</svg>")
    return "".join(parts)


def _y(value: float, top: float, plot_h: float) -> float:
    return MARGIN_TOP + plot_h * (1 - value / top)


def _y_axis(top: float, plot_h: float, label: str) -> str:
    """Gridlines at fifths of the axis, their values, and the axis label."""
    parts = ['<g class="axis">']
    for step in range(6):
        value = top * step / 5
        y = _y(value, top, plot_h)
        parts.append(
            f'<line class="grid" x1="{MARGIN_LEFT}" x2="{CHART_WIDTH - MARGIN_RIGHT}" '
            f'y1="{y:.2f}" y2="{y:.2f}"/>'
            f'<text class="tick" x="{MARGIN_LEFT - 6}" y="{y + 4:.2f}" text-anchor="end">'
            f"{value:.3g}</text>"
        )
    parts.append(
        f'<text class="axis-label" x="14" y="{MARGIN_TOP + plot_h / 2:.2f}" '
        f'transform="rotate(-90 14 {MARGIN_TOP + plot_h / 2:.2f})" text-anchor="middle">'
        f"{_e(label)}</text></g>"
    )
    return "".join(parts)


def _bar(
    bar: _Bar,
    x: float,
    width: float,
    top: float,
    plot_h: float,
    colors: Mapping[str, str],
    value_text: Callable[[_Bar], str],
) -> str:
    module = bar.module
    attrs = f'data-module="{_e(module.name)}" data-type="{_e(module.type)}"'
    parts = []
    inner = max(width * 0.85, 0.5)
    if bar.reference is not None:
        y = _y(bar.reference, top, plot_h)
        parts.append(
            f'<rect class="ref" {attrs} data-value="{bar.reference!r}" x="{x:.2f}" y="{y:.2f}" '
            f'width="{inner:.2f}" height="{MARGIN_TOP + plot_h - y:.2f}"/>'
        )
    if bar.value is not None:
        y = _y(bar.value, top, plot_h)
        parts.append(
            f'<rect class="bar type-{_e(module.type)}" {attrs} data-value="{bar.value!r}" '
            f'fill="{colors[module.type]}" x="{x:.2f}" y="{y:.2f}" width="{inner:.2f}" '
            f'height="{MARGIN_TOP + plot_h - y:.2f}"><title>{_e(value_text(bar))}</title></rect>'
        )
        if bar.label is not None:
            parts.append(
                f'<text class="bar-label" {attrs} x="{x + inner / 2:.2f}" y="{y - 4:.2f}" '
                f'text-anchor="middle">{_e(bar.label)}</text>'
            )
    return "".join(parts)


def _error_text(bar: _Bar) -> str:
    return (
        f"{bar.module.name}: output error {_fmt(bar.value)}, round-to-nearest {_fmt(bar.reference)}"
    )


def _layer_groups(modules: Sequence[_Module], value: Callable[[_Module], _Bar]) -> list[_Group]:
    """Modules grouped by decoder layer index (report order within a layer), others last."""
    order: dict[int | None, list[_Module]] = {}
    for module in modules:
        order.setdefault(module.layer, []).append(module)
    keys = sorted(k for k in order if k is not None) + ([None] if None in order else [])
    return [
        _Group(
            OTHER_LAYER if key is None else str(key),
            OTHER_LAYER if key is None else str(key),
            [value(m) for m in order[key]],
        )
        for key in keys
    ]


def _type_groups(modules: Sequence[_Module], value: Callable[[_Module], _Bar]) -> list[_Group]:
    """Modules grouped by type (first-appearance order), by layer within a type."""
    order: dict[str, list[_Module]] = {}
    for module in modules:
        order.setdefault(module.type, []).append(module)
    groups = []
    for key, members in order.items():
        members = sorted(members, key=lambda m: (m.layer is None, m.layer or 0))
        groups.append(_Group(key, key, [value(m) for m in members]))
    return groups


def _error_bar(module: _Module) -> _Bar:
    return _Bar(module, module.number("output_error"), module.number("rtn_output_error"))


def _damp_bar(module: _Module) -> _Bar:
    """percdamp, labelled with the retries when the first damping failed."""
    retries = module.number("damp_retries")
    label = f"+{retries:.0f}" if retries else None
    return _Bar(module, module.number("percdamp"), None, label)


def _damp_text(bar: _Bar) -> str:
    retries = bar.module.entry.get("damp_retries")
    return f"{bar.module.name}: percdamp {_fmt(bar.value)}, {_fmt(retries)} retry(ies)"


def _time_chart(layers: Sequence[_Layer]) -> str:
    """Per-layer wall time: ``svg#layer-time rect.time[data-layer=N]``."""
    axes = _Axes("layer-time", "wall time per decoder layer", "decoder layer", "seconds", 220)
    timed = [layer for layer in layers if layer.seconds is not None]
    if not timed:
        return _svg_empty(axes, "no layer timings in this report")
    top = _nice_max(max(layer.seconds or 0.0 for layer in timed))
    plot_w = CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = axes.height - MARGIN_TOP - MARGIN_BOTTOM
    width = plot_w / len(timed)
    label_every = max(1, math.ceil(len(timed) / MAX_AXIS_LABELS))
    parts = [_svg_head(axes), _y_axis(top, plot_h, axes.y_label), _x_title(axes)]
    for number, layer in enumerate(timed):
        seconds = layer.seconds or 0.0
        x = MARGIN_LEFT + number * width
        y = _y(seconds, top, plot_h)
        parts.append(
            f'<rect class="time" data-layer="{layer.index}" data-name="{_e(layer.name)}" '
            f'data-value="{seconds!r}" x="{x + width * 0.1:.2f}" y="{y:.2f}" '
            f'width="{width * 0.8:.2f}" height="{MARGIN_TOP + plot_h - y:.2f}">'
            f"<title>{_e(layer.name)}: {seconds:.2f} s</title></rect>"
        )
        if number % label_every == 0:
            parts.append(
                f'<text class="group-label" x="{x + width / 2:.2f}" '
                f'y="{axes.height - MARGIN_BOTTOM + 16}" text-anchor="middle">'
                f"{layer.index}</text>"
            )
    parts.append("</svg>")
    return "".join(parts)


def _legend(colors: Mapping[str, str]) -> str:
    items = "".join(
        f'<li data-type="{_e(name)}"><span class="swatch" style="background:{color}"></span>'
        f"{_e(name)}</li>"
        for name, color in colors.items()
    )
    return (
        f'<ul id="legend" class="legend">{items}<li class="ref-key"><span class="swatch ref">'
        "</span>round-to-nearest (dashed outline)</li></ul>"
    )


# --- sections ----------------------------------------------------------------------------------


def _summary(
    report: Mapping[str, Any], modules: Sequence[_Module], layers: Sequence[_Layer]
) -> str:
    errors = _mean(m.number("output_error") for m in modules)
    rtn = _mean(m.number("rtn_output_error") for m in modules)
    retries = sum(int(m.number("damp_retries") or 0) for m in modules)
    rows: list[tuple[str, str, str]] = [
        ("model_path", "model", _fmt(report.get("model_path"))),
        ("model_type", "model type", _fmt(report.get("model_type"))),
        ("device", "device", _fmt(report.get("device"))),
        ("config_sha256", "config sha256", _fmt(report.get("config_sha256"))),
        ("calibration_sha256", "calibration sha256", _fmt(report.get("calibration_sha256"))),
        (
            "calibration",
            "calibration",
            f"{_fmt(report.get('calibration_samples'))} sample(s), "
            f"{_fmt(report.get('calibration_tokens'))} token(s)",
        ),
        ("modules", "quantized modules", str(len(modules))),
        ("layers", "decoder layers", str(len(layers))),
        ("mean_output_error", "mean output error", _fmt(errors)),
        ("mean_rtn_output_error", "mean round-to-nearest error", _fmt(rtn)),
        ("damp_retries", "damping retries", str(retries)),
        ("capture_seconds", "calibration capture", _seconds(report.get("capture_seconds"))),
        ("total_seconds", "total time", _seconds(report.get("total_seconds"))),
    ]
    evaluation = report.get("evaluation")
    if isinstance(evaluation, Mapping):
        rows.append(
            (
                "perplexity",
                "perplexity",
                f"{_fmt(evaluation.get('ppl'), 6)} on {_fmt(evaluation.get('data'))} "
                f"({_fmt(evaluation.get('tokens'))} tokens, seqlen {_fmt(evaluation.get('seqlen'))}"
                f", stride {_fmt(evaluation.get('stride'))})",
            )
        )
    versions = ", ".join(
        f"{name} {_fmt(report.get(f'{name}_version'))}"
        for name in ("msquant", "torch", "transformers", "python")
    )
    rows.append(("versions", "versions", versions))
    items = "".join(
        f'<dt>{_e(label)}</dt><dd data-key="{key}">{_e(value)}</dd>' for key, label, value in rows
    )
    return f'<section id="run-summary"><h2>Run</h2><dl id="summary">{items}</dl></section>'


def _cell(module: _Module, key: str) -> str:
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
        seconds = _number(value)
        text = "-" if seconds is None else f"{seconds:.2f}"
    else:
        text = _fmt(value)
    if key in NUMERIC_COLUMNS:
        number = _number(value)
        data = "" if number is None else repr(number)
        return f'<td class="num" data-value="{data}">{_e(text)}</td>'
    return f'<td data-value="{_e(text)}">{_e(text)}</td>'


def _table(modules: Sequence[_Module]) -> str:
    head = "".join(
        f'<th data-key="{key}" scope="col" tabindex="0">{_e(label)}</th>'
        for key, label in TABLE_COLUMNS
    )
    rows = "".join(
        f'<tr data-module="{_e(m.name)}">'
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


STYLE = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;
background:#fff;max-width:1180px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px}
.sub{color:#666;margin:0 0 12px;word-break:break-all}
dl#summary{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:0}
dl#summary dt{color:#555}dl#summary dd{margin:0;font-family:ui-monospace,monospace;
word-break:break-all}
svg.chart{width:100%;height:auto;display:block;border:1px solid #e3e3e3;background:#fcfcfc}
svg .grid{stroke:#e6e6e6;stroke-width:1}svg .tick,svg .group-label,svg .axis-label{
font-size:11px;fill:#555}svg .empty{font-size:15px;fill:#888}
svg rect.ref{fill:none;stroke:#333;stroke-width:1;stroke-dasharray:3 2}
svg rect.time{fill:#4e79a7}svg .bar-label{font-size:11px;fill:#c00}
ul.legend{list-style:none;padding:0;margin:8px 0;display:flex;flex-wrap:wrap;gap:4px 16px}
.swatch{display:inline-block;width:12px;height:12px;margin-right:6px;vertical-align:-1px}
.swatch.ref{border:1px dashed #333;box-sizing:border-box}
table#modules{border-collapse:collapse;width:100%;font-size:12px}
table#modules th,table#modules td{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;
white-space:nowrap}table#modules td.num{text-align:right;font-family:ui-monospace,monospace}
table#modules th{cursor:pointer;background:#f4f4f4;position:sticky;top:0}
table#modules th[aria-sort=ascending]::after{content:" \\25B2"}
table#modules th[aria-sort=descending]::after{content:" \\25BC"}
.hint{color:#777;font-size:12px;margin:0 0 6px}
"""

# Sorts the module table by a header's data-key; reads only the DOM (no report data in script).
SCRIPT = """
(function () {
  var table = document.getElementById("modules");
  if (!table || !table.tBodies.length) { return; }
  var body = table.tBodies[0];
  var headers = Array.prototype.slice.call(table.tHead.rows[0].cells);
  function value(row, index, numeric) {
    var raw = row.cells[index] ? row.cells[index].getAttribute("data-value") : "";
    if (!numeric) { return raw || ""; }
    return raw === "" || raw === null ? null : parseFloat(raw);
  }
  function sortBy(key, descending) {
    var th = headers.filter(function (h) { return h.getAttribute("data-key") === key; })[0];
    if (!th) { return; }
    var index = th.cellIndex;
    var numeric = body.rows.length > 0 && body.rows[0].cells[index] &&
      body.rows[0].cells[index].classList.contains("num");
    var rows = Array.prototype.slice.call(body.rows).filter(function (r) {
      return !r.classList.contains("empty");
    });
    rows.sort(function (a, b) {
      var x = value(a, index, numeric), y = value(b, index, numeric);
      if (x === y) { return 0; }
      if (x === null) { return 1; }
      if (y === null) { return -1; }
      var order = numeric ? x - y : (x < y ? -1 : 1);
      return descending ? -order : order;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    headers.forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", descending ? "descending" : "ascending");
    table.setAttribute("data-sorted-by", (descending ? "-" : "") + key);
  }
  headers.forEach(function (th) {
    function toggle() {
      sortBy(th.getAttribute("data-key"), th.getAttribute("aria-sort") === "ascending");
    }
    th.addEventListener("click", toggle);
    th.addEventListener("keydown", function (e) { if (e.key === "Enter") { toggle(); } });
  });
  var match = /^#sort=(-?)([a-z_]+)$/.exec(window.location.hash);
  if (match) { sortBy(match[2], match[1] === "-"); }
  table.setAttribute("data-sortable", "true");
})();
"""

# Nothing may be fetched: styles and scripts are inline, images only data: URLs.
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
    "img-src data:; base-uri 'none'; form-action 'none'"
)


def render_html(report: Mapping[str, Any]) -> str:
    """The self-contained HTML page of a ``quant_report.json`` document (pure, deterministic).

    Sections: ``#run-summary`` (``dl#summary``), ``#errors`` (``svg#layer-errors``,
    ``svg#type-errors``, ``ul#legend``), ``#profile`` (``svg#layer-damping``, ``svg#layer-time``)
    and ``#module-table`` (``table#modules``). A report without modules or timings renders with a
    ``text.empty`` message in place of each chart.
    """
    layers = _layers(report)
    modules = _modules(report, layers)
    colors = _type_colors(modules)
    model = _fmt(report.get("model_path"))
    no_errors = "no output errors in this report (round-to-nearest runs use no calibration data)"
    error_title = "relative output error per module, by "
    by_layer = _grouped_chart(
        _Axes("layer-errors", error_title + "decoder layer", "decoder layer", "output error"),
        _layer_groups(modules, _error_bar),
        colors,
        _error_text,
        no_errors,
    )
    by_type = _grouped_chart(
        _Axes("type-errors", error_title + "module type", "module type", "output error"),
        _type_groups(modules, _error_bar),
        colors,
        _error_text,
        no_errors,
    )
    damping = _grouped_chart(
        _Axes(
            "layer-damping",
            "GPTQ damping (percdamp) per module, by decoder layer",
            "decoder layer (+N: damping retries after a failed Cholesky)",
            "percdamp",
            220,
        ),
        _layer_groups(modules, _damp_bar),
        colors,
        _damp_text,
        "no GPTQ damping in this report (no module was quantized with GPTQ)",
    )
    body = "".join(
        [
            f'<h1>msquant run report</h1><p class="sub" id="model">{_e(model)}</p>',
            _summary(report, modules, layers),
            '<section id="errors"><h2>Output error per module</h2>',
            '<p class="hint">Relative error of each layer\'s output on the calibration '
            "activations; the dashed outline is round-to-nearest's error for the same scheme.</p>",
            _legend(colors),
            "<h3>By decoder layer</h3>",
            by_layer,
            "<h3>By module type</h3>",
            by_type,
            "</section>",
            '<section id="profile"><h2>Damping and time per layer</h2>',
            "<h3>Damping used by GPTQ</h3>",
            damping,
            "<h3>Wall time per decoder layer</h3>",
            _time_chart(layers),
            "</section>",
            _table(modules),
        ]
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>msquant report: {_e(model)}</title><style>{STYLE}</style></head>"
        f"<body>{body}<script>{SCRIPT}</script></body></html>\n"
    )


# --- writing -----------------------------------------------------------------------------------


def write_html(report: Mapping[str, Any], path: str | Path) -> Path:
    """Render ``report`` and write it to ``path`` atomically (a temporary file in the same folder,
    then renamed): a reader never sees a half-written page, a failure leaves the old one.

    :raises MsquantInputError: when the folder does not exist or cannot be written.
    """
    target = Path(path)
    data = render_html(report).encode("utf-8")
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # mode 0o644 filtered by the umask, like any file the user creates
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, target)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise MsquantInputError(f"cannot write {target}: {exc.strerror}") from None
    logger.info("wrote %s (%d bytes)", target, len(data))
    return target
