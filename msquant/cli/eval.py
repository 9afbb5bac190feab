"""``msquant eval``: perplexity of a model folder or an export, or of two compared."""

from __future__ import annotations

import argparse
import json
from typing import Any

from msquant.cli.common import EXIT_OK, Parser, bool_flag, positive_int
from msquant.errors import MsquantInputError
from msquant.evaluate.perplexity import compare_perplexity, evaluate_perplexity
from msquant.evaluate.windows import DEFAULT_SEQLEN

__all__ = ["add_eval_parser", "run_eval"]


def add_eval_parser(sub: argparse._SubParsersAction[Parser], common: Parser) -> None:
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
        type=positive_int,
        default=DEFAULT_SEQLEN,
        help=f"window length in tokens (default {DEFAULT_SEQLEN})",
    )
    evaluate.add_argument(
        "--stride",
        type=positive_int,
        default=None,
        help="distance between window starts (default seqlen: non-overlapping)",
    )
    evaluate.add_argument(
        "--max_samples", type=positive_int, default=None, help="evaluate at most N windows"
    )
    evaluate.add_argument("--json", metavar="OUT.json", help="also write the result as JSON here")
    evaluate.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N] (default cpu)")
    evaluate.add_argument(
        "--trust_remote_code",
        nargs="?",
        const=True,
        default=False,
        type=bool_flag,
        help="allow model code from the model folder",
    )


def run_eval(args: argparse.Namespace) -> int:
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
