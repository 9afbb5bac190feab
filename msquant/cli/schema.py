"""``msquant schema``: print the JSON Schema of config files (for editors)."""

from __future__ import annotations

import argparse
import json

from msquant.cli.common import EXIT_OK, Parser
from msquant.config.spec import config_json_schema
from msquant.plugin.registry import default_registry

__all__ = ["add_schema_parser", "run_schema"]


def add_schema_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
    """``msquant schema`` and its options."""
    schema = sub.add_parser(
        "schema", parents=[common], help="print the JSON Schema of config files"
    )
    schema.add_argument("--indent", type=int, default=2)


def run_schema(args: argparse.Namespace) -> int:
    """Print the JSON Schema of config files for the installed processors."""
    print(json.dumps(config_json_schema(default_registry()), indent=args.indent))
    return EXIT_OK
