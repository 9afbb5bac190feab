"""Whole-model benchmark: GPTQ over SmolLM2-135M with 64 x 512 calibration tokens, through the CLI path.

Usage::

    python scripts/prepare_smollm2.py models/SmolLM2-135M-Instruct   # once
    python bench/e2e.py [--model_dir DIR] [--config YAML] [--samples 64] [--seqlen 512]

Calibration windows are cut from msquant's shipped calibration set (tokenized, concatenated and
split into ``--samples`` windows of ``--seqlen`` tokens). Prints the wall time of the whole
``msquant.quantize`` call (model load, calibration forwards, Hessians, solves, export) and per layer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_windows(model_dir: Path, samples: int, seqlen: int, out: Path) -> int:
    """Write ``samples`` windows of ``seqlen`` tokens as a .jsonl calibration file; returns tokens."""
    from transformers import AutoTokenizer

    from msquant.load.calibration import default_dataset_path, read_calibration_texts

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids: list[int] = []
    for text in read_calibration_texts(default_dataset_path()):
        ids.extend(tokenizer(text)["input_ids"])
    if len(ids) < samples * seqlen:
        raise SystemExit(f"the shipped set has {len(ids)} tokens; fewer than {samples} x {seqlen}")
    with out.open("w", encoding="utf-8") as handle:
        for i in range(samples):
            window = ids[i * seqlen : (i + 1) * seqlen]
            handle.write(json.dumps({"text": tokenizer.decode(window)}) + "\n")
    return samples * seqlen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument(
        "--config", type=Path, default=REPO / "yaml_examples" / "w8a16_per_channel_gptq.yaml"
    )
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument(
        "--no-checkpoints",
        action="store_true",
        help="run without the per-layer resume checkpoints (quantize(checkpoints=False))",
    )
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        print(
            f"{args.model_dir} is not prepared: run scripts/prepare_smollm2.py first",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.WARNING)
    import torch

    import msquant

    with tempfile.TemporaryDirectory() as tmp:
        calib = Path(tmp) / "calib.jsonl"
        tokens = make_windows(args.model_dir, args.samples, args.seqlen, calib)
        started = time.perf_counter()
        result = msquant.quantize(
            args.model_dir,
            Path(tmp) / "out",
            args.config,
            calib_path=calib,
            max_calib_tokens=args.seqlen,
            progress=False,
            checkpoints=not args.no_checkpoints,
        )
        seconds = time.perf_counter() - started
    layers = len({m.rsplit(".", 2)[0] for m in result.quantized_modules})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"config {args.config.name}, {args.samples} x {args.seqlen} = {tokens} calibration tokens"
    )
    print(f"quantized {len(result.quantized_modules)} linears in {layers} layers: {seconds:.1f} s total, "
          f"{seconds / max(layers, 1):.2f} s per layer")  # fmt: skip
    report = result.report
    loop = sum(layer.seconds for layer in report.layers)
    solves = sum(m.solve_seconds or 0.0 for m in report.modules)
    print(
        f"capture {report.capture_seconds or 0.0:.1f} s, layer loop {loop:.1f} s (GPTQ solves "
        f"{solves:.1f} s), the rest (model load, export, read-back check) {seconds - loop:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
