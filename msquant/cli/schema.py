"""``msquant schema``: print the JSON Schema of config files (for editors)."""

from __future__ import annotations

import argparse
import json

from msquant.cli.common import EXIT_OK, Parser
from msquant.config.spec import config_json_schema
from msquant.contracts.registry import default_registry

__all__ = ["add_schema_parser", "run_schema"]


def add_schema_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
    """``msquant schema`` and its options."""
    schema = sub.add_parser(
        "schema", parents=[common], help="print the JSON Schema of config files"
    )
    schema.add_argument(
        "--indent",
        type=_indent,
        default=2,
        help=f"spaces per nesting level, 0 to {MAX_INDENT} (default 2)",
    )


#: The widest ``--indent`` accepted (a huge one would print gigabytes of spaces).
MAX_INDENT = 16


def _indent(text: str) -> int:
    """An ``--indent`` value, 0 to :data:`MAX_INDENT` (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_INDENT:
        raise argparse.ArgumentTypeError(
            f"expected an integer from 0 to {MAX_INDENT}, got {text!r}"
        )
    return value


def run_schema(args: argparse.Namespace) -> int:
    """Print the JSON Schema of config files for the installed processors."""
    print(json.dumps(config_json_schema(default_registry()), indent=args.indent))
    return EXIT_OK
