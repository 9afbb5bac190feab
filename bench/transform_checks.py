"""Cost of the transform self-checks (issue 23): the share of each decoder layer's time spent
proving that smoothing and rotation keep the model's function, in real runs.

Each row quantizes a model with a shipped example (or an example with ``quarot`` in front) and
reads the run report: every layer's ``check_seconds`` (the data-flow proof, the function checks
and the probe's push to the next layer, all on the probe tokens) against the layer's whole time
(calibration forwards, statistics, folds, quantization), and the worst errors the checks measured.
The ratio is computed within each run, so machine load affects both sides alike.

Usage::

    python bench/activation_texts.py /tmp/texts
    python bench/transform_checks.py --model_dir models/SmolLM2-135M-Instruct --texts /tmp/texts \\
        [--out /tmp/check_runs] [--only iter_dynamic,quarot_dynamic] [--calib_samples 52]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import yaml

import msquant

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "yaml_examples"
#: row name -> (example config, whether ``quarot`` is put in front of its processors)
ROWS: dict[str, tuple[str, bool]] = {
    "iter_dynamic": ("w8a8_dynamic_iter_smooth.yaml", False),
    "flex_dynamic": ("w8a8_dynamic_flex_smooth.yaml", False),
    "iter_static": ("w8a8_static_iter_smooth.yaml", False),
    "quarot_dynamic": ("w8a8_dynamic_per_token.yaml", True),
    "quarot_w8a16": ("w8a16_per_channel_minmax.yaml", True),
}

logger = logging.getLogger("transform_checks_bench")


def row_config(name: str, directory: Path) -> Path:
    """The row's config file (the example, with ``quarot`` first where the row says so)."""
    example, rotate = ROWS[name]
    if not rotate:
        return EXAMPLES / example
    config = yaml.safe_load((EXAMPLES / example).read_text(encoding="utf-8"))
    config["spec"]["process"].insert(0, {"type": "quarot"})
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def run_row(name: str, args: argparse.Namespace) -> dict[str, object]:
    """Quantize with the row's config; the figures of its run report."""
    save = args.out / name
    shutil.rmtree(save, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    calib = args.out / "calib.txt"
    samples = (args.texts / "calib.txt").read_text(encoding="utf-8").split("\n\n")
    calib.write_text("\n\n".join(samples[: args.calib_samples]) + "\n", encoding="utf-8")
    started = time.perf_counter()
    msquant.quantize(
        args.model_dir,
        save,
        row_config(name, args.out),
        calib_path=calib,
        max_calib_tokens=args.seqlen,
        progress=False,
    )
    total = time.perf_counter() - started
    report = json.loads((save / "quant_report.json").read_text(encoding="utf-8"))
    layers = report["layers"]
    layer_seconds = sum(layer["seconds"] for layer in layers)
    check_seconds = sum(layer["check_seconds"] or 0.0 for layer in layers)
    checks = report["transform_checks"]
    return {
        "row": name,
        "run_seconds": round(total, 1),
        "layer_seconds": round(layer_seconds, 1),
        "check_seconds": round(check_seconds, 1),
        "check_share": check_seconds / layer_seconds if layer_seconds else float("nan"),
        "calibration_tokens": report["calibration_tokens"],
        "probe_tokens": report["probe_tokens"],
        "checks": sum(c["flow_checks"] + c["function_checks"] for c in checks),
        "worst_flow_error": max((c["flow_error"] or 0.0) for c in checks),
        "worst_function_error": max((c["function_error"] or 0.0) for c in checks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, required=True)
    parser.add_argument("--texts", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("/tmp/transform_check_runs"))
    parser.add_argument("--only", default="", help="comma-separated rows (default: all)")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per calibration sample")
    parser.add_argument(
        "--calib_samples", type=int, default=52, help="calibration texts used (the first ones)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    names = [n for n in args.only.split(",") if n] or list(ROWS)
    rows = []
    print(
        f"{'row':16} {'calib tok':>9} {'probe':>5} {'layers s':>9} {'checks s':>9} {'share':>7} "
        f"{'checks':>7} {'flow err':>9} {'func err':>9}"
    )
    for name in names:
        row = run_row(name, args)
        rows.append(row)
        print(
            f"{name:16} {row['calibration_tokens']:>9} {row['probe_tokens']:>5} "
            f"{row['layer_seconds']:>9} {row['check_seconds']:>9} {row['check_share']:>7.1%} "
            f"{row['checks']:>7} {row['worst_flow_error']:>9.2e} {row['worst_function_error']:>9.2e}",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
