"""``msquant validate``: validate YAML config files (exit 0 valid, 2 invalid)."""

from __future__ import annotations

import argparse
import sys

from msquant.cli.common import EXIT_INPUT, EXIT_OK, Parser
from msquant.config.spec import load_config
from msquant.contracts.registry import default_registry
from msquant.errors import MsquantInputError

__all__ = ["add_validate_parser", "run_validate"]


def add_validate_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
    """``msquant validate`` and its arguments."""
    validate = sub.add_parser(
        "validate", parents=[common], help="validate YAML config files (exit 0 valid, 2 invalid)"
    )
    validate.add_argument("config_paths", nargs="+", metavar="YAML")


def run_validate(args: argparse.Namespace) -> int:
    """Validate each file; every error goes to stderr, exit 2 when any file is invalid."""
    registry = default_registry()
    status = EXIT_OK
    for path in args.config_paths:
        try:
            load_config(path, registry)
        except MsquantInputError as exc:
            print(str(exc), file=sys.stderr)
            status = EXIT_INPUT
        else:
            print(f"{path}: valid", file=sys.stderr)
    return status
