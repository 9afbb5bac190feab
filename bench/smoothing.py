"""Smoothing bench: perplexity of W8A8 exports of SmolLM2-135M with and without outlier
suppression, and the run time of ``flex_smooth_quant`` + W8A8_DYNAMIC against W8A16 minmax, in one
run (docs/accuracy.md, "Smoothing").

The texts are those of the activation-scheme rows (``python bench/activation_texts.py DIR``: 52
calibration articles truncated to 512 tokens, held-out Wikipedia text), the configs the examples in
``yaml_examples/``; every export is written to disk and scored with ``msquant eval``'s code on the
first ``--windows`` windows of ``--seqlen`` tokens. The times are whole runs as a user runs them
(load, calibration, smoothing, quantization, export, read-back check), measured back to back in
this process, and the ratio to the W8A16 minmax run is printed.

Usage::

    python bench/activation_texts.py /tmp/texts
    python bench/smoothing.py --model_dir models/SmolLM2-135M-Instruct --texts /tmp/texts \\
        [--out /tmp/smoothing_runs] [--only w8a16,flex_dynamic] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import msquant

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "yaml_examples"
#: row name -> example config; the first is the time reference.
ROWS: dict[str, str] = {
    "w8a16": "w8a16_per_channel_minmax.yaml",
    "flex_dynamic": "w8a8_dynamic_flex_smooth.yaml",
    "iter_dynamic": "w8a8_dynamic_iter_smooth.yaml",
    "dynamic": "w8a8_dynamic_per_token.yaml",
    "iter_static": "w8a8_static_iter_smooth.yaml",
    "flex_static": "w8a8_static_flex_smooth.yaml",
}

logger = logging.getLogger("smoothing_bench")


def run_row(name: str, args: argparse.Namespace, score: bool) -> dict[str, float | str]:
    """Quantize with the row's example and (``score``) score the export; returns its figures."""
    save = args.out / name
    shutil.rmtree(save, ignore_errors=True)
    config = msquant.load_config(EXAMPLES / ROWS[name], msquant.plugin.default_registry())
    if args.enable_subgraph_type:
        kinds = args.enable_subgraph_type.split(",")
        for entry in config.spec.process:
            if hasattr(entry, "enable_subgraph_type"):
                entry.enable_subgraph_type = kinds
    started = time.perf_counter()
    msquant.quantize(
        args.model_dir,
        save,
        config,
        calib_path=args.texts / "calib.txt",
        max_calib_tokens=args.seqlen,
        progress=False,
    )
    seconds = time.perf_counter() - started
    logger.info("%s: quantized in %.1f s", name, seconds)
    ppl = float("nan")
    if score:
        ppl = msquant.evaluate_perplexity(
            save, args.texts / "wiki.txt", seqlen=args.seqlen, max_samples=args.windows
        ).ppl
    logger.info("%s: ppl %.3f, %.1f s", name, ppl, seconds)
    return {"row": name, "config": ROWS[name], "ppl": ppl, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--texts", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/smoothing_runs"))
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--only", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--json", type=Path, help="write the rows here as they finish")
    parser.add_argument(
        "--enable_subgraph_type",
        help="comma-separated subgraph types replacing the smoothing entries' own (norm-linear: "
        "the set msModelSlim's default adapter smooths)",
    )
    parser.add_argument(
        "--float_ppl", type=float, help="the float model's perplexity on these windows, if known"
    )
    parser.add_argument(
        "--time_only", default="w8a16", help="comma-separated rows that are timed but not scored"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    float_ppl = (
        args.float_ppl
        or msquant.evaluate_perplexity(
            args.model_dir, args.texts / "wiki.txt", seqlen=args.seqlen, max_samples=args.windows
        ).ppl
    )
    logger.info("float: ppl %.3f", float_ppl)
    rows = []
    for name in args.only.split(","):
        rows.append(run_row(name, args, name not in args.time_only.split(",")))
        if args.json:
            args.json.write_text(json.dumps({"float": float_ppl, "rows": rows}, indent=1))
    print(f"{'row (config)':<44} {'wiki ppl':>9} {'incr':>9} {'quant time':>11}")
    print(f"{'float':<44} {float_ppl:9.3f}")
    for row in rows:
        increase = 100 * (float(row["ppl"]) / float_ppl - 1)
        label = f"{row['row']} ({row['config']})"
        print(f"{label:<44} {row['ppl']:9.3f} {increase:+8.2f} % {row['seconds']:9.1f} s")
    times = {str(row["row"]): float(row["seconds"]) for row in rows}
    if "w8a16" in times and "flex_dynamic" in times:
        ratio = times["flex_dynamic"] / times["w8a16"]
        print(f"flex_smooth_quant + W8A8_DYNAMIC / W8A16 minmax run time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
