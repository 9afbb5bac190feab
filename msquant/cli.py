"""``msquant`` command line: ``quant``, ``verify``, ``validate``, ``schema``, ``eval``, ``plan``
and ``report``.

Flags of ``quant`` follow ``msmodelslim quant`` so vendor scripts can switch. Exit codes:
0 success, 2 bad input (config, paths, model, data, device; one clear message, no traceback), an
export that fails verification (the offending tensors named) or a full disk, 1 internal failure,
130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from msquant.backends import get_backend, parse_device
from msquant.config.spec import config_json_schema, load_config
from msquant.errors import MsquantInputError
from msquant.evaluate.perplexity import compare_perplexity, evaluate_perplexity
from msquant.evaluate.run_evaluation import prepare_evaluation
from msquant.evaluate.windows import DEFAULT_SEQLEN
from msquant.planning.build import build_plan
from msquant.planning.render import render_plan
from msquant.plugin.distributed import PeerLostError
from msquant.plugin.registry import default_registry
from msquant.presets import preset_config
from msquant.report.document import load_report, report_from_dict
from msquant.report.html.page import write_html
from msquant.report.regression import (
    EXIT_REGRESSION,
    check_ppl_baseline,
    compare_reports,
    load_baseline_report,
    parse_tolerance,
)
from msquant.report.run_report import REPORT_FILE
from msquant.report.table import render_report
from msquant.run.memory_estimate import parse_memory
from msquant.run.quantize import quantize
from msquant.verify import (
    ExportVerificationError,
    VerifyReport,
    export_folders,
    render_table,
    verify_export,
)
from msquant.version import __version__

__all__ = ["main", "build_parser"]

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
DEFAULT_LAYER_ERROR_INCREASE = "1%"
logger = logging.getLogger("msquant.cli")


def _bool_flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors exit with 2 and one line (argparse's default is 2 too)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    parser = _Parser(
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
    common = _Parser(add_help=False)
    common.add_argument(
        "--log_level",
        default=argparse.SUPPRESS,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="logging level (env MSQUANT_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
    source.add_argument("--quant_type", help="named preset instead of a YAML file: w8a16")
    quant.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N | npu | npu:N (default cpu); several devices (npu:0,1,2,3) "
        "start one process per device (dp_layer_wise)",
    )
    quant.add_argument(
        "--nproc",
        type=_positive_int,
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
        type=_bool_flag,
        help="allow model code from the model directory (flag, or True/False as in msModelSlim)",
    )
    quant.add_argument(
        "--max_calib_tokens", type=_positive_int, default=None, help="truncate calibration samples"
    )
    quant.add_argument(
        "--model_type", help="accepted for msModelSlim compatibility; read from config.json"
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
        help="original float model folder: report each layer's relative error against it",
    )
    verify.add_argument(
        "--json", action="store_true", help="print the report as JSON instead of a table"
    )

    validate = sub.add_parser(
        "validate", parents=[common], help="validate YAML config files (exit 0 valid, 2 invalid)"
    )
    validate.add_argument("config_paths", nargs="+", metavar="YAML")

    schema = sub.add_parser(
        "schema", parents=[common], help="print the JSON Schema of config files"
    )
    schema.add_argument("--indent", type=int, default=2)
    _add_eval_parser(sub, common)
    _add_plan_parser(sub, common)
    _add_report_parser(sub, common)
    return parser


def _add_eval_gate_arguments(quant: _Parser) -> None:
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
        type=_positive_int,
        default=None,
        help=f"window length of that evaluation (default {DEFAULT_SEQLEN})",
    )
    quant.add_argument(
        "--eval_stride",
        metavar="N",
        type=_positive_int,
        default=None,
        help="distance between its window starts (default --eval_seqlen)",
    )
    quant.add_argument(
        "--eval_max_samples",
        metavar="N",
        type=_positive_int,
        default=None,
        help="evaluate at most N windows",
    )
    quant.add_argument(
        "--max_ppl_increase",
        metavar="TOL",
        help="with --baseline_report and --eval_data: exit 3 when the perplexity grew more than "
        "this relative to the baseline's, e.g. 0.5%% or 0.005",
    )


def _add_report_parser(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
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


def _add_eval_parser(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
    """``msquant eval``: perplexity of a model folder or export, or of two compared."""
    evaluate = sub.add_parser(
        "eval",
        parents=[common],
        help="perplexity of a model or an export on a local text file (exit 0 ok, 2 bad input)",
    )
    evaluate.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="float Hugging Face model folder or one export folder (Ascend, MindIE, GPTQ, "
        "compressed-tensors)",
    )
    evaluate.add_argument(
        "--compare",
        nargs=2,
        metavar=("ORIGINAL", "QUANTIZED"),
        help="evaluate both on the same tokens and print the relative increase",
    )
    evaluate.add_argument(
        "--data", required=True, help="local text file (.txt, .jsonl or .json as for calibration)"
    )
    evaluate.add_argument(
        "--seqlen",
        type=_positive_int,
        default=DEFAULT_SEQLEN,
        help=f"window length in tokens (default {DEFAULT_SEQLEN})",
    )
    evaluate.add_argument(
        "--stride",
        type=_positive_int,
        default=None,
        help="distance between window starts (default seqlen: non-overlapping)",
    )
    evaluate.add_argument(
        "--max_samples", type=_positive_int, default=None, help="evaluate at most N windows"
    )
    evaluate.add_argument("--json", metavar="OUT.json", help="also write the result as JSON here")
    evaluate.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N] (default cpu)")
    evaluate.add_argument(
        "--trust_remote_code",
        nargs="?",
        const=True,
        default=False,
        type=_bool_flag,
        help="allow model code from the model folder",
    )


def _add_plan_parser(sub: argparse._SubParsersAction[_Parser], common: _Parser) -> None:
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
    source.add_argument("--quant_type", help="named preset instead of a YAML file: w8a16")
    plan.add_argument(
        "--json", action="store_true", help="print the plan as JSON instead of a table"
    )
    plan.add_argument(
        "--trust_remote_code",
        nargs="?",
        const=True,
        default=False,
        type=_bool_flag,
        help="allow model code from the model directory",
    )


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (it may be replaced after set-up)."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _: object) -> None:
        pass


def _configure_logging(level: str) -> None:
    handler = _CurrentStderrHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger("msquant")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def _cmd_quant(args: argparse.Namespace) -> int:
    if args.config_path is None and args.quant_type is None:
        raise MsquantInputError(
            "pass --config_path YAML or --quant_type NAME (e.g. --quant_type w8a16)"
        )
    if args.quant_type is not None:
        try:
            config: object = preset_config(args.quant_type)
        except KeyError as exc:
            raise MsquantInputError(str(exc.args[0])) from None
    else:
        config = args.config_path
    baseline, tolerance, ppl_tolerance = _regression_gate(args)  # checked before any work
    devices = _process_devices(args.device, args.nproc)
    if len(devices) > 1:
        return _spawn_quant(args, config, devices, baseline, tolerance, ppl_tolerance)
    result = quantize(
        args.model_path,
        args.save_path,
        config,  # type: ignore[arg-type]
        device=args.device,
        **_quant_options(args),
    )
    logger.info(
        "quantized %d linear layer(s) of %s in %.1f s -> %s",
        len(result.quantized_modules),
        result.model_type,
        result.seconds,
        result.save_path,
    )
    return _gate(baseline, result.report.to_dict(), tolerance, ppl_tolerance)


def _quant_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`msquant.quantize` that ``quant``'s flags set (all but the
    paths, the config and the device)."""
    return dict(
        calib_path=args.calib_path,
        trust_remote_code=args.trust_remote_code,
        max_calib_tokens=args.max_calib_tokens,
        progress=not args.no_progress,
        overwrite=args.overwrite,
        verify=not args.no_verify,
        eval_data=args.eval_data,
        eval_seqlen=args.eval_seqlen or DEFAULT_SEQLEN,
        eval_stride=args.eval_stride,
        eval_max_samples=args.eval_max_samples,
        max_memory=None if args.max_memory is None else parse_memory(args.max_memory),
        resume=args.resume,
        checkpoints=not args.no_checkpoints,
    )


def _gate(
    baseline: dict[str, object] | None,
    report: dict[str, object],
    tolerance: float | None,
    ppl_tolerance: float | None,
) -> int:
    """Exit code of the regression gate: 3 when the run got worse than its baseline."""
    if baseline is not None:
        outcome = compare_reports(baseline, report, tolerance, ppl_tolerance)
        if not outcome.ok:
            print(f"msquant: regression against the baseline:\n{outcome.render()}", file=sys.stderr)
            return EXIT_REGRESSION
        logger.info("%s", outcome.render())
    return EXIT_OK


def _process_devices(device: str, nproc: int | None) -> list[str]:
    """One device string per process: several device indices start one process each
    (``npu:0,1,2,3``); ``--nproc N`` starts N processes on the CPU. Under torchrun (``WORLD_SIZE``
    set) this process is already one of the group: one device."""
    spec = parse_device(device)
    if "WORLD_SIZE" in os.environ:
        if len(spec.indices) > 1 or (nproc or 1) > 1:
            raise MsquantInputError(
                "under torchrun each process takes one device (e.g. --device npu:$LOCAL_RANK); "
                "drop --nproc and the device list"
            )
        return [device]
    if len(spec.indices) > 1:
        if nproc is not None and nproc != len(spec.indices):
            raise MsquantInputError(
                f"--nproc {nproc} does not match the {len(spec.indices)} devices of {device}"
            )
        return [f"{spec.kind}:{index}" for index in spec.indices]
    if nproc is not None and nproc > 1 and spec.kind != "cpu":
        raise MsquantInputError(
            f"--nproc {nproc} on {spec.kind}: name the devices instead, e.g. "
            f"--device {spec.kind}:{','.join(map(str, range(nproc)))}"
        )
    return [device] * (nproc or 1)


def _spawn_quant(
    args: argparse.Namespace,
    config: object,
    devices: list[str],
    baseline: dict[str, object] | None,
    tolerance: float | None,
    ppl_tolerance: float | None,
) -> int:
    """Run ``quant`` as a ``dp_layer_wise`` group of one process per device; process 0 writes."""
    from torch.multiprocessing import ProcessExitedException

    from msquant.run.launch import spawn

    for device in dict.fromkeys(devices):  # a missing device fails here, before any process starts
        get_backend(device)
    options = _quant_options(args)
    level = logging.getLogger("msquant").level
    logger.info("dp_layer_wise: starting %d processes on %s", len(devices), ", ".join(devices))
    try:
        spawn(_quant_process, len(devices), args.model_path, args.save_path, config, options,
              devices, level)  # fmt: skip
    except ProcessExitedException as exc:
        return int(exc.exit_code)
    report = json.loads((Path(args.save_path) / REPORT_FILE).read_text(encoding="utf-8"))
    logger.info("quantized with %d processes -> %s", len(devices), args.save_path)
    return _gate(baseline, report, tolerance, ppl_tolerance)


def _quant_process(
    rank: int,
    model_path: str,
    save_path: str,
    config: object,
    options: dict[str, object],
    devices: list[str],
    level: int,
) -> None:
    """One process of a spawned ``dp_layer_wise`` group (exits with the CLI's exit codes)."""
    _configure_logging(logging.getLevelName(level))
    if devices[rank] == "cpu":  # share the cores out instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))
    try:
        quantize(model_path, save_path, config, device=devices[rank], **options)  # type: ignore[arg-type]
    except MsquantInputError as exc:
        if rank == 0:
            print(f"msquant: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except ExportVerificationError as exc:
        print(f"msquant: error: {exc}\nnothing was written to the save path", file=sys.stderr)
        sys.exit(EXIT_INPUT)
    except PeerLostError as exc:
        print(_peer_lost(exc), file=sys.stderr)
        sys.exit(EXIT_INTERNAL)


def _peer_lost(exc: PeerLostError) -> str:
    """One line for a ``dp_layer_wise`` process whose group lost a member, with the way on."""
    return (
        f"msquant: error: {exc}; nothing was written to the save path. Once the cause is fixed, "
        "rerun the same command with --resume to continue after the last finished layer "
        "(runs with --no_checkpoints start over)"
    )


def _regression_gate(
    args: argparse.Namespace,
) -> tuple[dict[str, object] | None, float | None, float | None]:
    """The baseline report and the tolerances of its gates, validated up front.

    The per-module gate runs when ``--max_layer_error_increase`` is given, or by default when no
    gate is named; the perplexity gate when ``--max_ppl_increase`` is given (it needs
    ``--eval_data``, and a baseline evaluated on the same file and windows).
    """
    if args.eval_data is None:
        for flag in ("eval_seqlen", "eval_stride", "eval_max_samples", "max_ppl_increase"):
            if getattr(args, flag) is not None:
                raise MsquantInputError(
                    f"--{flag} needs --eval_data TEXT_FILE (the text the perplexity is measured on)"
                )
    if args.baseline_report is None:
        for flag in ("max_layer_error_increase", "max_ppl_increase"):
            if getattr(args, flag) is not None:
                raise MsquantInputError(f"--{flag} needs --baseline_report")
        return None, None, None
    ppl_tolerance = None
    if args.max_ppl_increase is not None:
        ppl_tolerance = parse_tolerance(args.max_ppl_increase)
    layer_text = args.max_layer_error_increase
    if layer_text is None and ppl_tolerance is None:
        layer_text = DEFAULT_LAYER_ERROR_INCREASE
    tolerance = None if layer_text is None else parse_tolerance(layer_text)
    baseline = load_baseline_report(args.baseline_report)
    if ppl_tolerance is not None:
        evaluation = prepare_evaluation(
            args.eval_data,
            args.eval_seqlen or DEFAULT_SEQLEN,
            args.eval_stride,
            args.eval_max_samples,
        )
        check_ppl_baseline(baseline, evaluation.settings())
    return baseline, tolerance, ppl_tolerance


def _cmd_verify(args: argparse.Namespace) -> int:
    """Verify every export at the path; the report goes to stdout, failures also to stderr."""
    reports = [
        verify_export(folder, model_path=args.model_path)
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


def _cmd_validate(args: argparse.Namespace) -> int:
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


def _cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_json_schema(default_registry()), indent=args.indent))
    return EXIT_OK


def _cmd_eval(args: argparse.Namespace) -> int:
    """Print the perplexity (or both and the relative increase); write JSON when asked."""
    if (args.model_dir is None) == (args.compare is None):
        raise MsquantInputError(
            "pass either MODEL_DIR or --compare ORIGINAL QUANTIZED (exactly one of them)"
        )
    options: dict[str, Any] = dict(
        seqlen=args.seqlen,
        stride=args.stride,
        max_samples=args.max_samples,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
    )
    if args.compare is not None:
        original, quantized = args.compare
        comparison = compare_perplexity(original, quantized, args.data, **options)
        summary, data = comparison.summary(), comparison.to_dict()
    else:
        result = evaluate_perplexity(args.model_dir, args.data, **options)
        summary, data = result.summary(), result.to_dict()
    print(summary)
    if args.json is not None:
        try:
            with open(args.json, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise MsquantInputError(f"cannot write --json {args.json}: {exc}") from exc
    return EXIT_OK


def _cmd_report(args: argparse.Namespace) -> int:
    """Print the report's table, or write its HTML page with ``--html``."""
    data = load_report(args.report_path)
    if args.html is None:
        print(render_report(report_from_dict(data)))
    else:
        write_html(data, args.html)
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace) -> int:
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


COMMANDS = {
    "quant": _cmd_quant,
    "verify": _cmd_verify,
    "validate": _cmd_validate,
    "schema": _cmd_schema,
    "eval": _cmd_eval,
    "plan": _cmd_plan,
    "report": _cmd_report,
}


class Terminated(BaseException):
    """SIGTERM (a scheduler preempting the job, ``kill``): unwinds like Ctrl-C, so that a
    checkpointed run keeps its work for ``--resume`` and says so."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` while a command runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def disk_full(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain that says the disk (or quota) is full, or None. Writers
    report it as an :class:`OSError` (``ENOSPC``, ``EDQUOT``) or, from Rust, as text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return current
        text = str(current)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return current
        current = current.__cause__ or current.__context__
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``msquant`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    _configure_logging("DEBUG" if getattr(args, "debug", False) else args.log_level)
    try:
        with _sigterm_unwinds():
            return COMMANDS[args.command](args)
    except MsquantInputError as exc:
        print(f"msquant: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except ExportVerificationError as exc:
        print(f"msquant: error: {exc}\nnothing was written to the save path", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print("msquant: interrupted; nothing was written to the save path", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print(
            "msquant: terminated (SIGTERM); nothing was written to the save path", file=sys.stderr
        )
        return EXIT_TERMINATED
    except PeerLostError as exc:
        print(_peer_lost(exc), file=sys.stderr)
        return EXIT_INTERNAL
    except Exception as exc:
        full = disk_full(exc)
        if full is not None:
            print(
                f"msquant: error: the disk is full ({' '.join(str(full).split())}); free space, "
                "or choose a --save_path on a disk with room for the export and its checkpoints; "
                "nothing was written to the save path",
                file=sys.stderr,
            )
            return EXIT_INPUT
        logger.exception(
            "internal error (please report it with the command line and this traceback)"
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
