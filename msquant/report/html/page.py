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
- Every text taken from the report is HTML-escaped; the report may come from anywhere.
- :func:`render_html` is a pure function of the report document: the same report gives the same
  page, byte for byte. Missing or malformed fields render as ``-`` instead of failing, so reports
  of older or newer msquant versions still render.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
from msquant.report.html.sections import summary_section, table_section
from msquant.report.html.text import esc, fmt

__all__ = ["STYLE", "SCRIPT", "CSP", "render_html", "write_html"]

logger = logging.getLogger(__name__)


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
    body = "".join(
        [
            f'<h1>msquant run report</h1><p class="sub" id="model">{esc(model)}</p>',
            summary_section(report, modules, layers),
            '<section id="errors"><h2>Output error per module</h2>',
            '<p class="hint">Relative error of each layer\'s output on the calibration '
            "activations; the dashed outline is round-to-nearest's error for the same scheme.</p>",
            legend(colors),
            "<h3>By decoder layer</h3>",
            by_layer,
            "<h3>By module type</h3>",
            by_type,
            "</section>",
            '<section id="profile"><h2>Damping and time per layer</h2>',
            "<h3>Damping used by GPTQ</h3>",
            damping,
            "<h3>Wall time per decoder layer</h3>",
            time_chart(layers),
            "</section>",
            table_section(modules),
        ]
    )
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>msquant report: {esc(model)}</title><style>{STYLE}</style></head>"
        f"<body>{body}<script>{SCRIPT}</script></body></html>\n"
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
