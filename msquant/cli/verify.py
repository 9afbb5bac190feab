"""``msquant verify``: read exports back and check them (exit 0 consistent, 2 inconsistent)."""

from __future__ import annotations

import argparse
import json
import sys

from msquant.cli.common import EXIT_INPUT, EXIT_OK, Parser
from msquant.verify import (
    ExportVerificationError,
    VerifyReport,
    export_folders,
    render_table,
    verify_export,
)

__all__ = ["add_verify_parser", "run_verify"]


def add_verify_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
    """``msquant verify`` and its arguments."""
    verify = sub.add_parser(
        "verify",
        parents=[common],
        help="read an export back and check it (exit 0 consistent, 2 inconsistent)",
    )
    verify.add_argument(
        "save_path",
        metavar="SAVE_PATH",
        help="export folder (Ascend / MindIE, GPTQ or compressed-tensors; or a folder whose "
        "subfolders hold the exports of several savers)",
    )
    verify.add_argument(
        "--model_path",
        help="original float model folder: report each layer's relative error against it, and "
        "compare both models' logits on a few tokens",
    )
    verify.add_argument(
        "--no_forward",
        "--no-forward",
        dest="no_forward",
        action="store_true",
        help="with --model_path, skip the logits comparison (which loads the original model "
        "whole, then the export rebuilt in float)",
    )
    verify.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )


def run_verify(args: argparse.Namespace) -> int:
    """Verify every export at the path; the report goes to stdout, failures also to stderr."""
    reports = [
        verify_export(folder, model_path=args.model_path, forward=not args.no_forward)
        for folder in export_folders(args.save_path)
    ]
    if args.json:
        print(json.dumps(_reports_json(reports), indent=2))
    else:
        print("\n\n".join(render_table(report) for report in reports))
    failed = [report for report in reports if not report.ok]
    for report in failed:
        print(f"msquant: error: {ExportVerificationError(report)}", file=sys.stderr)
    return EXIT_INPUT if failed else EXIT_OK


def _reports_json(reports: list[VerifyReport]) -> dict[str, object]:
    """One report's dict, or ``{"ok", "exports": [...]}`` for several savers' subfolders."""
    if len(reports) == 1:
        return reports[0].to_dict()
    return {"ok": all(r.ok for r in reports), "exports": [r.to_dict() for r in reports]}
