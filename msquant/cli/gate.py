"""The regression gate of ``msquant quant --baseline_report``: its flags checked before any work, and
the exit code of a finished run against its baseline.
"""

from __future__ import annotations

import argparse
import logging
import sys

from msquant.cli.common import EXIT_OK
from msquant.errors import MsquantInputError
from msquant.evaluate.run_evaluation import prepare_evaluation
from msquant.evaluate.windows import DEFAULT_SEQLEN
from msquant.report.regression import (
    EXIT_REGRESSION,
    check_ppl_baseline,
    compare_reports,
    load_baseline_report,
    parse_tolerance,
)

__all__ = ["DEFAULT_LAYER_ERROR_INCREASE", "regression_gate", "gate_exit_code"]

logger = logging.getLogger("msquant.cli")


DEFAULT_LAYER_ERROR_INCREASE = "1%"


def regression_gate(
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


def gate_exit_code(
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
