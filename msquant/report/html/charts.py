"""The report page's charts as inline SVG: bars grouped by decoder layer or module type (round-to-nearest
as a dashed outline behind each bar), and the wall time per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from msquant.report.html.content import OTHER_LAYER, PageLayer, PageModule
from msquant.report.html.text import esc, fmt, nice_max

__all__ = [
    "CHART_WIDTH",
    "CHART_HEIGHT",
    "MARGIN_LEFT",
    "GROUP_GAP",
    "MAX_AXIS_LABELS",
    "Bar",
    "Group",
    "Axes",
    "svg_head",
    "svg_empty",
    "x_title",
    "grouped_chart",
    "error_text",
    "layer_groups",
    "type_groups",
    "error_bar",
    "damp_bar",
    "damp_text",
    "time_chart",
    "legend",
]


CHART_WIDTH = 1100
CHART_HEIGHT = 300
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 12, 16, 44
GROUP_GAP = 0.6  # gap between groups, in bar widths
MAX_AXIS_LABELS = 40


@dataclass(frozen=True)
class Bar:
    """One bar slot of a grouped chart."""

    module: PageModule
    value: float | None
    reference: float | None  # the round-to-nearest value, drawn as a dashed outline
    label: str | None = None  # drawn above the bar (damping retries)


@dataclass(frozen=True)
class Group:
    """The bars of one group along x (a decoder layer or a module type)."""

    label: str
    key: str  # data-group value
    bars: list[Bar]


@dataclass(frozen=True)
class Axes:
    """Titles and size of one chart."""

    chart_id: str
    title: str
    x_label: str
    y_label: str
    height: int = CHART_HEIGHT


def svg_head(axes: Axes) -> str:
    """The opening ``svg`` tag of a chart, with its title."""
    return (
        f'<svg id="{axes.chart_id}" class="chart" role="img" aria-label="{esc(axes.title)}" '
        f'viewBox="0 0 {CHART_WIDTH} {axes.height}" xmlns="http://www.w3.org/2000/svg">'
        f"<title>{esc(axes.title)}</title>"
    )


def svg_empty(axes: Axes, text: str) -> str:
    """A chart without data: its frame and one ``text.empty`` line saying why."""
    return (
        svg_head(axes) + f'<text class="empty" x="{CHART_WIDTH / 2}" y="{axes.height / 2}" '
        f'text-anchor="middle">{esc(text)}</text></svg>'
    )


def x_title(axes: Axes) -> str:
    """The x axis label, centred under the plot."""
    x = MARGIN_LEFT + (CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT) / 2
    return (
        f'<text class="axis-label" x="{x:.2f}" y="{axes.height - 8}" text-anchor="middle">'
        f"{esc(axes.x_label)}</text>"
    )


def grouped_chart(
    axes: Axes,
    groups: Sequence[Group],
    colors: Mapping[str, str],
    value_text: Callable[[Bar], str],
    empty_text: str,
) -> str:
    """An inline SVG of bars grouped along x (layers or module types), one bar per module.

    Each bar is ``rect.bar`` (filled with its module type's color) and, when the bar has a
    reference value, ``rect.ref`` drawn as a dashed outline at the reference's height behind it.
    """
    bars = [bar for group in groups for bar in group.bars]
    values = [v for bar in bars for v in (bar.value, bar.reference) if v is not None]
    if not values:
        return svg_empty(axes, empty_text)
    top = nice_max(max(values))
    plot_w = CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = axes.height - MARGIN_TOP - MARGIN_BOTTOM
    slots = len(bars) + GROUP_GAP * (len(groups) + 1)
    width = plot_w / slots
    parts = [svg_head(axes), _y_axis(top, plot_h, axes.y_label), x_title(axes)]
    label_every = max(1, math.ceil(len(groups) / MAX_AXIS_LABELS))
    x = MARGIN_LEFT + GROUP_GAP * width
    for number, group in enumerate(groups):
        start = x
        parts.append(f'<g class="group" data-group="{esc(group.key)}">')
        for bar in group.bars:
            parts.append(_bar(bar, x, width, top, plot_h, colors, value_text))
            x += width
        # keep a label near the right edge inside the chart (about 6.5 px per character)
        center = min((start + x) / 2, CHART_WIDTH - 2 - 3.3 * len(group.label))
        if number % label_every == 0:
            parts.append(
                f'<text class="group-label" x="{center:.2f}" y="{axes.height - MARGIN_BOTTOM + 16}" '
                f'text-anchor="middle">{esc(group.label)}</text>'
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
        f"{esc(label)}</text></g>"
    )
    return "".join(parts)


def _bar(
    bar: Bar,
    x: float,
    width: float,
    top: float,
    plot_h: float,
    colors: Mapping[str, str],
    value_text: Callable[[Bar], str],
) -> str:
    module = bar.module
    attrs = f'data-module="{esc(module.name)}" data-type="{esc(module.type)}"'
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
            f'<rect class="bar type-{esc(module.type)}" {attrs} data-value="{bar.value!r}" '
            f'fill="{colors[module.type]}" x="{x:.2f}" y="{y:.2f}" width="{inner:.2f}" '
            f'height="{MARGIN_TOP + plot_h - y:.2f}"><title>{esc(value_text(bar))}</title></rect>'
        )
        if bar.label is not None:
            parts.append(
                f'<text class="bar-label" {attrs} x="{x + inner / 2:.2f}" y="{y - 4:.2f}" '
                f'text-anchor="middle">{esc(bar.label)}</text>'
            )
    return "".join(parts)


def error_text(bar: Bar) -> str:
    """The tooltip of an output-error bar."""
    return (
        f"{bar.module.name}: output error {fmt(bar.value)}, round-to-nearest {fmt(bar.reference)}"
    )


def layer_groups(modules: Sequence[PageModule], value: Callable[[PageModule], Bar]) -> list[Group]:
    """Modules grouped by decoder layer index (report order within a layer), others last."""
    order: dict[int | None, list[PageModule]] = {}
    for module in modules:
        order.setdefault(module.layer, []).append(module)
    keys = sorted(k for k in order if k is not None) + ([None] if None in order else [])
    return [
        Group(
            OTHER_LAYER if key is None else str(key),
            OTHER_LAYER if key is None else str(key),
            [value(m) for m in order[key]],
        )
        for key in keys
    ]


def type_groups(modules: Sequence[PageModule], value: Callable[[PageModule], Bar]) -> list[Group]:
    """Modules grouped by type (first-appearance order), by layer within a type."""
    order: dict[str, list[PageModule]] = {}
    for module in modules:
        order.setdefault(module.type, []).append(module)
    groups = []
    for key, members in order.items():
        members = sorted(members, key=lambda m: (m.layer is None, m.layer or 0))
        groups.append(Group(key, key, [value(m) for m in members]))
    return groups


def error_bar(module: PageModule) -> Bar:
    """A module's output error, round-to-nearest's as the reference."""
    return Bar(module, module.number("output_error"), module.number("rtn_output_error"))


def damp_bar(module: PageModule) -> Bar:
    """percdamp, labelled with the retries when the first damping failed."""
    retries = module.number("damp_retries")
    label = f"+{retries:.0f}" if retries else None
    return Bar(module, module.number("percdamp"), None, label)


def damp_text(bar: Bar) -> str:
    """The tooltip of a damping bar."""
    retries = bar.module.entry.get("damp_retries")
    return f"{bar.module.name}: percdamp {fmt(bar.value)}, {fmt(retries)} retry(ies)"


def time_chart(layers: Sequence[PageLayer]) -> str:
    """Per-layer wall time: ``svg#layer-time rect.time[data-layer=N]``."""
    axes = Axes("layer-time", "wall time per decoder layer", "decoder layer", "seconds", 220)
    timed = [layer for layer in layers if layer.seconds is not None]
    if not timed:
        return svg_empty(axes, "no layer timings in this report")
    top = nice_max(max(layer.seconds or 0.0 for layer in timed))
    plot_w = CHART_WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = axes.height - MARGIN_TOP - MARGIN_BOTTOM
    width = plot_w / len(timed)
    label_every = max(1, math.ceil(len(timed) / MAX_AXIS_LABELS))
    parts = [svg_head(axes), _y_axis(top, plot_h, axes.y_label), x_title(axes)]
    for number, layer in enumerate(timed):
        seconds = layer.seconds or 0.0
        x = MARGIN_LEFT + number * width
        y = _y(seconds, top, plot_h)
        parts.append(
            f'<rect class="time" data-layer="{layer.index}" data-name="{esc(layer.name)}" '
            f'data-value="{seconds!r}" x="{x + width * 0.1:.2f}" y="{y:.2f}" '
            f'width="{width * 0.8:.2f}" height="{MARGIN_TOP + plot_h - y:.2f}">'
            f"<title>{esc(layer.name)}: {seconds:.2f} s</title></rect>"
        )
        if number % label_every == 0:
            parts.append(
                f'<text class="group-label" x="{x + width / 2:.2f}" '
                f'y="{axes.height - MARGIN_BOTTOM + 16}" text-anchor="middle">'
                f"{layer.index}</text>"
            )
    parts.append("</svg>")
    return "".join(parts)


def legend(colors: Mapping[str, str]) -> str:
    """The legend: one swatch per module type, and the round-to-nearest outline."""
    items = "".join(
        f'<li data-type="{esc(name)}"><span class="swatch" style="background:{color}"></span>'
        f"{esc(name)}</li>"
        for name, color in colors.items()
    )
    return (
        f'<ul id="legend" class="legend">{items}<li class="ref-key"><span class="swatch ref">'
        "</span>round-to-nearest (dashed outline)</li></ul>"
    )
