"""``msquant report REPORT.json --html OUT.html``: the run report as a self-contained HTML page.

The page shows what ``quant_report.json`` holds where people would rather look than read: the run
summary, each module's relative output error next to round-to-nearest's (by decoder layer, and by
module type), the damping GPTQ used and the time per layer, and a table of every module.

Design choices:

- Charts are inline SVG (:mod:`~msquant.report.html.charts`), so the page renders without
  JavaScript and without any network access (a Content-Security-Policy forbids every fetch); a
  few lines of inline JavaScript only make the module table sortable (click a header, or open
  the page with ``#sort=KEY`` / ``#sort=-KEY`` for descending).
- Elements carry stable ids, classes and ``data-*`` attributes (``svg#layer-errors
  rect.bar[data-module="..."]``, ``table#modules tr[data-module="..."]``, ...) so tests and
  scripts can find them.
- The page's markup is Jinja templates (``templates/*.html.j2``) with autoescaping: every text
  taken from the report is HTML-escaped (the report may come from anywhere); the charts' SVG is
  built and escaped in Python, where its geometry is computed.
- :func:`render_html` is a pure function of the report document: the same report gives the same
  page, byte for byte. Missing or malformed fields render as ``-`` instead of failing, so reports
  of older or newer msquant versions still render.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from msquant.errors import MsquantInputError
from msquant.report.html.charts import (
    Axes,
    damp_bar,
    damp_text,
    error_bar,
    error_text,
    grouped_chart,
    layer_groups,
    legend,
    time_chart,
    type_groups,
)
from msquant.report.html.content import page_layers, page_modules, type_colors
from msquant.report.html.sections import TABLE_COLUMNS, summary_rows, table_rows
from msquant.report.html.text import fmt

__all__ = ["STYLE", "SCRIPT", "CSP", "render_html", "write_html"]

logger = logging.getLogger(__name__)


def _asset(name: str) -> str:
    """A static file of the page (its stylesheet or script), from ``templates/``."""
    return (
        resources.files(__package__)
        .joinpath("templates")
        .joinpath(name)
        .read_text(encoding="utf-8")
    )


@functools.cache
def _templates() -> jinja2.Environment:
    """The page's templates (``templates/*.html.j2``), every expression HTML-escaped; undefined
    names are errors, not empty text."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


STYLE = "\n" + _asset("style.css")

# Sorts the module table by a header's data-key; reads only the DOM (no report data in script).
SCRIPT = "\n" + _asset("sort.js")

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
    layers = page_layers(report)
    modules = page_modules(report, layers)
    colors = type_colors(modules)
    model = fmt(report.get("model_path"))
    no_errors = "no output errors in this report (round-to-nearest runs use no calibration data)"
    error_title = "relative output error per module, by "
    by_layer = grouped_chart(
        Axes("layer-errors", error_title + "decoder layer", "decoder layer", "output error"),
        layer_groups(modules, error_bar),
        colors,
        error_text,
        no_errors,
    )
    by_type = grouped_chart(
        Axes("type-errors", error_title + "module type", "module type", "output error"),
        type_groups(modules, error_bar),
        colors,
        error_text,
        no_errors,
    )
    damping = grouped_chart(
        Axes(
            "layer-damping",
            "GPTQ damping (percdamp) per module, by decoder layer",
            "decoder layer (+N: damping retries after a failed Cholesky)",
            "percdamp",
            220,
        ),
        layer_groups(modules, damp_bar),
        colors,
        damp_text,
        "no GPTQ damping in this report (no module was quantized with GPTQ)",
    )
    charts = {
        "legend": legend(colors),
        "by_layer": by_layer,
        "by_type": by_type,
        "damping": damping,
        "time": time_chart(layers),
    }
    return (
        _templates()
        .get_template("page.html.j2")
        .render(
            csp=Markup(CSP),
            style=Markup(STYLE),
            script=Markup(SCRIPT),
            model=model,
            summary=summary_rows(report, modules, layers),
            # the charts are SVG built (and escaped) by msquant.report.html.charts
            charts={name: Markup(svg) for name, svg in charts.items()},
            columns=TABLE_COLUMNS,
            rows=table_rows(modules),
        )
    )


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
