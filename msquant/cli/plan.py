"""``msquant plan``: the per-module plan of a config on a model, without loading weights."""

from __future__ import annotations

import argparse
import json
import sys

from msquant.cli.common import EXIT_INPUT, EXIT_OK, Parser, bool_flag, positive_int
from msquant.cli.practice import quant_type_config
from msquant.planning.build import build_plan
from msquant.planning.render import render_plan
from msquant.run.memory_estimate import MemoryEstimate, check_memory, format_size, parse_memory
from msquant.run.plan_memory import plan_with_memory

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
        "--max_memory",
        metavar="SIZE",
        help="host memory the run may use (e.g. 64GiB), as for quant: print the run's peak "
        "memory estimate with its breakdown, and exit 2 when it needs more",
    )
    plan.add_argument(
        "--calib_path",
        help="with --max_memory: the calibration file the run would use (default: the config's "
        "spec.dataset, else the shipped set); its token count sizes the estimate",
    )
    plan.add_argument(
        "--max_calib_tokens",
        type=positive_int,
        default=None,
        help="with --max_memory: truncate calibration samples, as for quant",
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
    """Print the plan (table or JSON) on stdout, and with ``--max_memory`` the memory estimate;
    exit 2 when the config cannot be applied or the run would need more memory."""
    config: object = args.config_path
    if args.quant_type is not None:
        config = quant_type_config(args.quant_type, args.model_path)
    limit = None if args.max_memory is None else parse_memory(args.max_memory)
    estimate = None
    if limit is None:
        result = build_plan(
            args.model_path,
            config,  # type: ignore[arg-type]
            trust_remote_code=args.trust_remote_code,
            allow_float_export=args.allow_float_export,
        )
    else:
        result, estimate = plan_with_memory(
            args.model_path,
            config,  # type: ignore[arg-type]
            calib_path=args.calib_path,
            max_calib_tokens=args.max_calib_tokens,
            trust_remote_code=args.trust_remote_code,
            allow_float_export=args.allow_float_export,
        )
    if args.json:
        data = result.to_dict()
        if estimate is not None and limit is not None:
            data["memory"] = {**estimate.to_dict(), "limit_bytes": limit}
        print(json.dumps(data, indent=2))
    else:
        print(render_plan(result))
        if estimate is not None and limit is not None:
            print(_memory_text(estimate, limit))
    if not result.ok:
        count = len(result.errors)
        print(
            f"msquant: error: the config cannot be applied to this model ({count} problem(s), "
            "listed in the plan above)",
            file=sys.stderr,
        )
        return EXIT_INPUT
    if estimate is not None and limit is not None:
        check_memory(estimate, limit)
    return EXIT_OK


def _memory_text(estimate: MemoryEstimate, limit: int) -> str:
    """The estimate's breakdown under its verdict."""
    verdict = "fits" if estimate.total <= limit else "does not fit"
    return (
        f"memory: the run needs about {format_size(estimate.total)} at {estimate.layer}, "
        f"{verdict} in --max_memory {format_size(limit)}\n{estimate.table()}"
    )
