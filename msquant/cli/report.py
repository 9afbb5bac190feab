"""``msquant report``: a run report as a table, or as a self-contained HTML page."""

from __future__ import annotations

import argparse

from msquant.cli.common import EXIT_OK, Parser
from msquant.report.document import load_report, report_from_dict
from msquant.report.html.page import write_html
from msquant.report.table import render_report

__all__ = ["add_report_parser", "run_report"]


def add_report_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
    """``msquant report``: a run report as a table, or as a self-contained HTML page."""
    report = sub.add_parser(
        "report",
        parents=[common],
        help="print a quant_report.json as a table, or render it as an HTML page with --html",
    )
    report.add_argument("report_path", metavar="REPORT.json", help="quant_report.json of a run")
    report.add_argument(
        "--html",
        metavar="OUT.html",
        help="write a self-contained HTML page (charts, no network) here instead of printing",
    )


def run_report(args: argparse.Namespace) -> int:
    """Print the report's table, or write its HTML page with ``--html``."""
    data = load_report(args.report_path)
    if args.html is None:
        print(render_report(report_from_dict(data)))
    else:
        write_html(data, args.html)
    return EXIT_OK
