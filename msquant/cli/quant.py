"""``msquant quant``: quantize a model and write deployment weights (flags follow
``msmodelslim quant`` so vendor scripts can switch).
"""

from __future__ import annotations

import argparse
import logging

from msquant.cli.common import Parser, bool_flag, positive_int
from msquant.cli.gate import gate_exit_code, regression_gate
from msquant.cli.practice import quant_type_config
from msquant.cli.quant_options import process_devices, quant_options
from msquant.cli.spawn import spawn_quant
from msquant.errors import MsquantInputError
from msquant.evaluate.windows import DEFAULT_SEQLEN
from msquant.run.quantize import quantize

__all__ = ["add_quant_parser", "run_quant"]

logger = logging.getLogger("msquant.cli")


def add_quant_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
    """``msquant quant`` and its flags."""
    quant = sub.add_parser(
        "quant", parents=[common], help="quantize a model and write deployment weights"
    )
    quant.add_argument("--model_path", required=True, help="local Hugging Face model directory")
    quant.add_argument(
        "--save_path",
        required=True,
        help="output directory (created; a previous export is replaced only with --overwrite)",
    )
    source = quant.add_mutually_exclusive_group()
    source.add_argument("--config_path", help="YAML config (msModelSlim v1 schema)")
    source.add_argument(
        "--quant_type",
        help="msModelSlim's quant type instead of a YAML file: w8a16, w8a8, w4a8 (the practices "
        "in msquant/data/practices; docs/cli.md)",
    )
    quant.add_argument(
        "--tag",
        nargs="*",
        default=None,
        metavar="TAG",
        help="msModelSlim's scenario tags (e.g. vllm Atlas_A2_Inference); accepted and logged: "
        "msquant ships one practice per --quant_type, as msModelSlim's default practices, "
        "which tags do not select among",
    )
    quant.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N | npu | npu:N (default cpu; msModelSlim's default is npu); "
        "several devices (npu:0,1,2,3) start one process per device (dp_layer_wise)",
    )
    quant.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="processes sharing the work on the CPU (dp_layer_wise over gloo; default 1)",
    )
    quant.add_argument(
        "--max_memory",
        metavar="SIZE",
        help="host memory the run may use (e.g. 64GiB): a run estimated to need more is refused "
        "before weights load, with the breakdown",
    )
    quant.add_argument(
        "--calib_path", help="calibration file (.jsonl/.json/.txt), overrides spec.dataset"
    )
    quant.add_argument(
        "--trust_remote_code",
        nargs="?",
        const=True,
        default=False,
        type=bool_flag,
        help="allow model code from the model directory (flag, or True/False as in msModelSlim)",
    )
    quant.add_argument(
        "--max_calib_tokens", type=positive_int, default=None, help="truncate calibration samples"
    )
    quant.add_argument(
        "--model_type",
        metavar="NAME",
        help="msModelSlim's model adapter name (default, Qwen3-8B, QwQ-32B, ...): the smoothing "
        "processors smooth the subgraph types msModelSlim 26.1.0's adapter of that name finds "
        "(default: norm-linear only); without it, every type msquant's adapter finds",
    )
    quant.add_argument("--debug", action="store_true", help="same as --log_level DEBUG")
    quant.add_argument("--no_progress", action="store_true", help="hide progress bars")
    quant.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a previous export at --save_path (only once the new one is complete)",
    )
    quant.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run of --save_path after its last finished layer (same "
        "command otherwise); the result is the uninterrupted run's",
    )
    quant.add_argument(
        "--allow_float_export",
        action="store_true",
        help="write the export even when the config quantizes no linear layer (a rotated or "
        "smoothed float model); without it such a config is refused",
    )
    quant.add_argument(
        "--no_checkpoints",
        action="store_true",
        help="write no checkpoint after each layer (a killed run then cannot be resumed)",
    )
    quant.add_argument(
        "--no-verify",
        "--no_verify",
        dest="no_verify",
        action="store_true",
        help="skip reading the export back and comparing it with the in-memory result",
    )
    quant.add_argument(
        "--baseline_report",
        metavar="JSON",
        help="quant_report.json of an earlier run: exit 3 when a module's output error grew more "
        "than --max_layer_error_increase or the perplexity more than --max_ppl_increase (the "
        "export is still written)",
    )
    quant.add_argument(
        "--max_layer_error_increase",
        metavar="TOL",
        help="allowed relative growth of each module's output error against --baseline_report, "
        "e.g. 5%% or 0.05 (default 1%% when --max_ppl_increase is not given)",
    )
    _add_eval_gate_arguments(quant)


def _add_eval_gate_arguments(quant: Parser) -> None:
    """``quant --eval_data ... --max_ppl_increase``: perplexity in the report, and its gate."""
    quant.add_argument(
        "--eval_data",
        metavar="TEXT_FILE",
        help="after the run, measure the quantized model's perplexity on this local text file "
        "(.txt/.jsonl/.json as for msquant eval) and record it in quant_report.json",
    )
    quant.add_argument(
        "--eval_seqlen",
        metavar="N",
        type=positive_int,
        default=None,
        help=f"window length of that evaluation (default {DEFAULT_SEQLEN})",
    )
    quant.add_argument(
        "--eval_stride",
        metavar="N",
        type=positive_int,
        default=None,
        help="distance between its window starts (default --eval_seqlen)",
    )
    quant.add_argument(
        "--eval_max_samples",
        metavar="N",
        type=positive_int,
        default=None,
        help="evaluate at most N windows",
    )
    quant.add_argument(
        "--max_ppl_increase",
        metavar="TOL",
        help="with --baseline_report and --eval_data: exit 3 when the perplexity grew more than "
        "this relative to the baseline's, e.g. 0.5%% or 0.005",
    )


def run_quant(args: argparse.Namespace) -> int:
    """Quantize in this process, or in one process per device; then the regression gate."""
    if args.config_path is None and args.quant_type is None:
        raise MsquantInputError(
            "pass --config_path YAML or --quant_type NAME (e.g. --quant_type w8a16)"
        )
    if args.quant_type is not None:
        config: object = quant_type_config(args.quant_type, args.model_path, args.model_type)
    else:
        config = args.config_path
    if args.tag is not None:
        logger.info(
            "--tag %s: accepted for msModelSlim's command line and not used (msquant ships one "
            "practice per --quant_type, like msModelSlim's default practices, which tags do not "
            "select among; with --config_path msModelSlim ignores tags too)",
            " ".join(args.tag) or "(none)",
        )
    baseline, tolerance, ppl_tolerance = regression_gate(args)  # checked before any work
    devices = process_devices(args.device, args.nproc)
    if len(devices) > 1:
        return spawn_quant(args, config, devices, baseline, tolerance, ppl_tolerance)
    result = quantize(
        args.model_path,
        args.save_path,
        config,  # type: ignore[arg-type]
        device=args.device,
        **quant_options(args),
    )
    logger.info(
        "quantized %d linear layer(s) of %s in %.1f s -> %s",
        len(result.quantized_modules),
        result.model_type,
        result.seconds,
        result.save_path,
    )
    return gate_exit_code(baseline, result.report.to_dict(), tolerance, ppl_tolerance)
