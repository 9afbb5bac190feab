"""``msquant plan``: the per-module plan of a config on a model, without loading weights."""

from __future__ import annotations

import argparse
import json
import sys

from msquant.cli.common import EXIT_INPUT, EXIT_OK, Parser, bool_flag
from msquant.config.presets import preset_config
from msquant.errors import MsquantInputError
from msquant.planning.build import build_plan
from msquant.planning.render import render_plan

__all__ = ["add_plan_parser", "run_plan"]


def add_plan_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
    """``msquant plan``: the per-module plan of a config on a model, without quantizing."""
    plan = sub.add_parser(
        "plan",
        parents=[common],
        help="print which scheme every linear layer gets and which rule decided, without "
        "loading weights (exit 0 ok, 2 the config cannot be applied)",
    )
    plan.add_argument("--model_path", required=True, help="local Hugging Face model directory")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--config_path", help="YAML config (msModelSlim v1 schema)")
    source.add_argument(
        "--quant_type",
        help="msModelSlim's quant type instead of a YAML file: w8a16, w8a8, w4a8 (the practices "
        "in msquant/data/practices; docs/cli.md)",
    )
    plan.add_argument(
        "--json", action="store_true", help="print the plan as JSON instead of a table"
    )
    plan.add_argument(
        "--allow_float_export",
        action="store_true",
        help="as for quant: a config that quantizes no linear layer is no error",
    )
    plan.add_argument(
        "--trust_remote_code",
        nargs="?",
        const=True,
        default=False,
        type=bool_flag,
        help="allow model code from the model directory",
    )


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan (table or JSON) on stdout; exit 2 when the config cannot be applied."""
    config: object = args.config_path
    if args.quant_type is not None:
        try:
            config = preset_config(args.quant_type)
        except KeyError as exc:
            raise MsquantInputError(str(exc.args[0])) from None
    result = build_plan(
        args.model_path,
        config,  # type: ignore[arg-type]
        trust_remote_code=args.trust_remote_code,
        allow_float_export=args.allow_float_export,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else render_plan(result))
    if not result.ok:
        count = len(result.errors)
        print(
            f"msquant: error: the config cannot be applied to this model ({count} problem(s), "
            "listed in the plan above)",
            file=sys.stderr,
        )
        return EXIT_INPUT
    return EXIT_OK
