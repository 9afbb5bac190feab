"""Activation-practices bench: every shipped configuration that quantizes activations, run on one
model folder through the command line, each export scored by ``msquant eval`` (docs/accuracy.md,
"A second family").

The rows are found, not listed: every ``yaml_examples/*.yaml`` whose ``linear_quant`` (also inside
a ``group``) sets ``qconfig.act``, and every ``--quant_type`` practice of
``msquant/data/practices``, plus the W8A16 minmax example as the weights-only reference. A row is
tagged with the processors it runs before quantization (smoothing, rotation); ``--plain`` keeps
the rows that run none.

Each row is one ``python -m msquant quant`` process (the calibration is the bench's texts:
``python bench/activation_texts.py DIR``, the first ``--calib_samples`` of its 52 articles, each
cut to ``--seqlen`` tokens) and one ``python -m msquant eval`` of the export (the first
``--windows`` windows of ``--seqlen`` tokens of the held-out text), so the numbers are what a user
gets from the two commands, and a refusal (exit 2, such as ``quarot`` on a model it cannot rotate)
is a row with its message, not a crash of the bench. ``time`` is the whole quantization command
(start-up, load, calibration, processors, export, read-back check).

Usage::

    python bench/activation_texts.py /tmp/texts
    python scripts/prepare_model.py --model gemma3-270m models/gemma-3-270m
    python bench/activation_practices.py --model_dir models/gemma-3-270m --texts /tmp/texts \\
        [--plain] [--only NAME,...] [--calib_samples 52] [--out /tmp/practice_runs] [--json F]
    python bench/activation_practices.py --list        # the rows and what each runs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from msquant.config.presets import PRACTICE_FILES

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "yaml_examples"
PRACTICES = REPO / "msquant" / "data" / "practices"
#: The weights-only reference row (no activation quantization).
REFERENCE = "w8a16_per_channel_minmax"
#: Processor types that only quantize (every other type transforms the model first).
QUANTIZERS = {"linear_quant", "group"}
#: Exit status of ``msquant`` for bad input (a clear refusal, not a crash).
EXIT_INPUT = 2

logger = logging.getLogger("activation_practices")


@dataclass(frozen=True)
class Row:
    """One configuration: its name, the ``msquant quant`` arguments choosing it, and the
    processors it runs before quantizing (empty for a plain row)."""

    name: str
    args: tuple[str, ...]
    transforms: tuple[str, ...]


@dataclass
class Result:
    """What one row measured (``ppl`` None when the run was refused or failed)."""

    row: str
    transforms: str
    status: str
    ppl: float | None = None
    seconds: float | None = None
    detail: str = ""


def _processes(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The processor entries of a config (``spec.prior`` and ``spec.process``), groups opened."""
    spec = config.get("spec") or {}
    entries = list(spec.get("prior") or []) + list(spec.get("process") or [])
    flat: list[dict[str, Any]] = []
    while entries:
        entry = entries.pop(0)
        flat.append(entry)
        entries[:0] = entry.get("configs") or []
    return flat


def _row(name: str, args: tuple[str, ...], config_file: Path) -> Row | None:
    """The row of a config, or None when no linear_quant in it quantizes activations (except
    the reference row)."""
    processes = _processes(yaml.safe_load(config_file.read_text(encoding="utf-8")))
    acts = [
        p
        for p in processes
        if p.get("type") == "linear_quant" and (p.get("qconfig") or {}).get("act")
    ]
    if not acts and name != REFERENCE:
        return None
    transforms = tuple(
        dict.fromkeys(str(p["type"]) for p in processes if p.get("type") not in QUANTIZERS)
    )
    return Row(name, args, transforms)


def discover_rows() -> list[Row]:
    """The reference row, the activation examples, then the ``--quant_type`` practices."""
    rows = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        row = _row(path.stem, ("--config_path", str(path)), path)
        if row is not None:
            rows.append(row)
    rows.sort(key=lambda r: r.name != REFERENCE)
    # one row per --quant_type value; the run picks the model family's practice where msquant
    # ships one (``<value>-<family>.yaml``), as the CLI does for a user
    for path in sorted(PRACTICES / file for file in PRACTICE_FILES.values()):
        row = _row(f"--quant_type {path.stem}", ("--quant_type", path.stem), path)
        if row is not None:
            rows.append(row)
    return rows


def _calibration(texts: Path, samples: int, out: Path) -> Path:
    """The first ``samples`` calibration samples (blank-line separated) as a file under ``out``."""
    blocks = [
        b
        for b in texts.joinpath("calib.txt").read_text(encoding="utf-8").split("\n\n")
        if b.strip()
    ]
    if samples > len(blocks):
        raise SystemExit(
            f"--calib_samples {samples}: {texts / 'calib.txt'} has {len(blocks)} samples"
        )
    path = out / f"calib_{samples}.txt"
    path.write_text("\n\n".join(blocks[:samples]) + "\n", encoding="utf-8")
    return path


def _msquant(*args: str, log: Path) -> tuple[int, float]:
    """Run ``python -m msquant ARGS`` with its output in ``log``; returns (exit code, seconds)."""
    started = time.perf_counter()
    with log.open("w", encoding="utf-8") as sink:
        code = subprocess.run(
            [sys.executable, "-m", "msquant", *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            check=False,
        ).returncode
    return code, time.perf_counter() - started


def _last_error(log: Path) -> str:
    """The last ``ERROR`` line of a log (or its last line)."""
    lines = [
        line
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines()
        if line.strip()
    ]
    errors = [line for line in lines if "ERROR" in line or "error:" in line]
    return (errors or lines or [""])[-1].strip()


def evaluate(model: Path, args: argparse.Namespace, name: str) -> float:
    """``msquant eval`` of a folder on the bench's windows; returns the perplexity."""
    report = args.out / f"{name}.eval.json"
    code, seconds = _msquant(
        "eval", str(model), "--data", str(args.texts / "wiki.txt"), "--seqlen", str(args.seqlen),
        "--max_samples", str(args.windows), "--json", str(report), log=args.out / f"{name}.eval.log",
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(
            f"msquant eval {model} exited with {code}: {_last_error(args.out / f'{name}.eval.log')}"
        )
    ppl = float(json.loads(report.read_text(encoding="utf-8"))["ppl"])
    logger.info("%s: ppl %.3f (eval %.1f s)", name, ppl, seconds)
    return ppl


def run_row(row: Row, args: argparse.Namespace, calib: Path) -> Result:
    """Quantize with the row's configuration and score the export."""
    slug = row.name.replace("--quant_type ", "quant_type_")
    save = args.out / slug
    shutil.rmtree(save, ignore_errors=True)
    log = args.out / f"{slug}.quant.log"
    code, seconds = _msquant(
        "quant", "--model_path", str(args.model_dir), "--save_path", str(save), *row.args,
        "--calib_path", str(calib), "--max_calib_tokens", str(args.seqlen), "--no_progress", log=log,
    )  # fmt: skip
    transforms = ",".join(row.transforms) or "-"
    if code != 0:
        status = "refused" if code == EXIT_INPUT else f"failed ({code})"
        logger.info("%s: %s after %.1f s: %s", row.name, status, seconds, _last_error(log))
        return Result(row.name, transforms, status, None, seconds, _last_error(log))
    logger.info("%s: quantized in %.1f s", row.name, seconds)
    ppl = evaluate(save, args, slug)
    if not args.keep:
        shutil.rmtree(save, ignore_errors=True)
    return Result(row.name, transforms, "ok", ppl, seconds)


def render(float_ppl: float, results: list[Result]) -> str:
    """The table printed at the end."""
    lines = [
        f"{'row':<40} {'runs before quantizing':<24} {'ppl':>9} {'incr':>10} {'quant time':>11}"
    ]
    lines.append(f"{'float':<40} {'':<24} {float_ppl:9.3f}")
    for r in results:
        time_cell = f"{r.seconds:9.1f} s" if r.seconds is not None else ""
        if r.ppl is None:
            lines.append(
                f"{r.row:<40} {r.transforms:<24} {r.status:>20} {time_cell:>11}  {r.detail[:160]}"
            )
            continue
        incr = 100 * (r.ppl / float_ppl - 1)
        lines.append(f"{r.row:<40} {r.transforms:<24} {r.ppl:9.3f} {incr:+9.2f}% {time_cell:>11}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path)
    parser.add_argument("--texts", type=Path, help="folder written by bench/activation_texts.py")
    parser.add_argument("--out", type=Path, default=Path("/tmp/practice_runs"))
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--calib_samples", type=int, default=52)
    parser.add_argument("--only", help="comma-separated row names (see --list)")
    parser.add_argument(
        "--plain", action="store_true", help="only the rows without smoothing or rotation"
    )
    parser.add_argument("--float_ppl", type=float, help="the float model's perplexity, if known")
    parser.add_argument("--keep", action="store_true", help="keep the exports")
    parser.add_argument("--json", type=Path, help="write the results here as they finish")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = discover_rows()
    if args.list:
        for row in rows:
            shown = " ".join(a.replace(f"{REPO}/", "") for a in row.args)
            print(f"{row.name:<40} {','.join(row.transforms) or '-':<24} {shown}")
        return
    if args.model_dir is None or args.texts is None:
        parser.error("--model_dir and --texts are required (or --list)")
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {r.name for r in rows}
        if unknown:
            parser.error(f"unknown rows {sorted(unknown)}; see --list")
        rows = [r for r in rows if r.name in wanted]
    if args.plain:
        rows = [r for r in rows if not r.transforms]
    args.out.mkdir(parents=True, exist_ok=True)
    calib = _calibration(args.texts, args.calib_samples, args.out)
    logger.info("threads: %s; rows: %s", os.cpu_count(), ", ".join(r.name for r in rows))
    float_ppl = args.float_ppl or evaluate(args.model_dir, args, "float")
    results: list[Result] = []
    for row in rows:
        results.append(run_row(row, args, calib))
        if args.json:
            payload = {
                "model": str(args.model_dir),
                "float_ppl": float_ppl,
                "rows": [asdict(r) for r in results],
            }
            args.json.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    print(render(float_ppl, results))


if __name__ == "__main__":
    main()
