"""The ``msquant`` argument parser: the global options and one subparser per subcommand."""

from __future__ import annotations

import argparse
import os

from msquant.cli.common import Parser
from msquant.cli.eval import add_eval_parser
from msquant.cli.plan import add_plan_parser
from msquant.cli.quant import add_quant_parser
from msquant.cli.report import add_report_parser
from msquant.cli.schema import add_schema_parser
from msquant.cli.validate import add_validate_parser
from msquant.cli.verify import add_verify_parser
from msquant.version import __version__

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    parser = Parser(
        prog="msquant", description="Quantize LLMs for Ascend NPUs and CUDA GPUs from YAML."
    )
    parser.add_argument("--version", action="version", version=f"msquant {__version__}")
    parser.add_argument(
        "--log_level",
        default=os.environ.get("MSQUANT_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="logging level (env MSQUANT_LOG_LEVEL)",
    )
    # --log_level is accepted after the subcommand too (``msquant quant ... --log_level DEBUG``).
    common = Parser(add_help=False)
    common.add_argument(
        "--log_level",
        default=argparse.SUPPRESS,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="logging level (env MSQUANT_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    add_quant_parser(sub, common)
    add_verify_parser(sub, common)
    add_validate_parser(sub, common)
    add_schema_parser(sub, common)
    add_eval_parser(sub, common)
    add_plan_parser(sub, common)
    add_report_parser(sub, common)
    return parser
