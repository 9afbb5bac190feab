"""Accuracy bench: perplexity of float, round-to-nearest and GPTQ exports of SmolLM2-135M, in one run.

For the default GPTQ YAML (int4 group 64 symmetric, ``method: gptq`` with every other option left
to its default), the 4-bit and 8-bit example YAMLs and, for comparison, GPTQ with
``ext.numerics: msmodelslim`` (msModelSlim's numerics) and llm-compressor's GPTQ, prints the
perplexity on held-out encyclopedia text (in domain: the calibration is encyclopedia text too) and
on news (out of domain), the increase over the float model, GPTQ's increase as a fraction of
round-to-nearest's on the same grid, and each variant's run time.

Texts (offline; :mod:`eval_texts`): calibration ``--calib_samples`` x ``--seqlen`` tokens (64 x 512)
from Wikipedia articles at even positions of the shortened dump that gensim ships as test data,
held-out ``--eval_samples`` x ``--seqlen`` tokens (20 x 512; the issue's 40 with ``--eval_samples 40``)
from the articles at odd positions
(no article on both sides) and from the Lee corpus of ABC news. Every export is written to disk
and read back with ``msquant eval``'s reader (:func:`msquant.evaluate.load_model_for_eval`), so
msquant's and llm-compressor's exports are scored by the same code on the same tokens.

llm-compressor 0.14 pins an older transformers, so it runs in its own virtual environment (a
subprocess, ``bench/llmcompressor_oneshot.py``) when ``--llmcompressor_python`` names that
environment's python (default ``/work/venvs/llmcompressor/bin/python`` when it exists)::

    python -m venv /work/venvs/llmcompressor && cd /work/venvs/llmcompressor
    bin/pip install torch==2.13.0 && bin/pip install llmcompressor==0.14.0.1

Usage (on a 2-core CPU, alone: each GPTQ run takes 3-4 minutes, llm-compressor's about 3, each
evaluation of 2 x 20 windows 1-2 minutes, so the default rows take about 30 minutes and each
``--variant`` adds about 5; on a machine shared with other jobs, several times that. ``--skip``
leaves rows out, ``--json`` keeps them, ``--render`` prints one table from several runs)::

    pip install --no-deps gensim==4.4.0         # the texts (only its data files are read)
    python scripts/prepare_smollm2.py models/SmolLM2-135M-Instruct   # once
    python bench/accuracy.py [--model_dir DIR] [--skip w8,llmcompressor,msmodelslim]
    python bench/accuracy.py --only w4 --variant 'no act-order={"desc_act": false}'   # experiments
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_texts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "yaml_examples"
W4_EXAMPLE = EXAMPLES / "w4a16_per_group64_gptq_compressed_tensors.yaml"
W8_EXAMPLE = EXAMPLES / "w8a16_per_channel_gptq.yaml"
W8_RTN_EXAMPLE = EXAMPLES / "w8a16_per_channel_minmax.yaml"
LLMCOMPRESSOR_PYTHON = Path("/work/venvs/llmcompressor/bin/python")
LLMCOMPRESSOR_SCRIPT = Path(__file__).resolve().parent / "llmcompressor_oneshot.py"

#: The default YAML: W4 group 64 symmetric GPTQ, every other option at its default.
DEFAULT_W4: dict[str, Any] = {
    "apiversion": "modelslim_v1",
    "spec": {
        "process": [
            {
                "type": "linear_quant",
                "qconfig": {
                    "weight": {
                        "dtype": "int4",
                        "scope": "per_group",
                        "symmetric": True,
                        "method": "gptq",
                        "ext": {"group_size": 64},
                    }
                },
            }
        ],
        "save": [{"type": "compressed_tensors"}],
    },
}
GPTQ_ONLY_EXT = (
    "numerics", "percdamp", "block_size", "desc_act", "static_groups", "calib_inputs",
    "true_sequential", "damp_auto_increment", "max_damp_retries", "experts_per_pass",
)  # fmt: skip


@dataclass
class Texts:
    """Calibration file and held-out token streams."""

    calib_path: Path
    calib_ids: list[list[int]]
    held_out: dict[str, Any]  # name -> 1-D token tensor


@dataclass
class Row:
    """One measured model."""

    section: str
    name: str
    ppl: dict[str, float] = field(default_factory=dict)
    seconds: float | None = None
    grid_full_range: bool | None = None  # the grid of a quantized model (for the RTN baseline)
    rtn: bool = False
    note: str = ""


def weight_of(config: dict[str, Any]) -> dict[str, Any]:
    """The ``qconfig.weight`` mapping of a one-entry config."""
    return config["spec"]["process"][0]["qconfig"]["weight"]


def with_ext(config: dict[str, Any], **ext: Any) -> dict[str, Any]:
    """A copy of ``config`` with ``ext`` keys set."""
    copied = copy.deepcopy(config)
    weight_of(copied).setdefault("ext", {}).update(ext)
    return copied


def as_minmax(config: dict[str, Any], full_range: bool) -> dict[str, Any]:
    """The round-to-nearest counterpart of a GPTQ config: same scheme, ``method: minmax``."""
    copied = copy.deepcopy(config)
    weight = weight_of(copied)
    weight["method"] = "minmax"
    ext = {k: v for k, v in (weight.get("ext") or {}).items() if k not in GPTQ_ONLY_EXT}
    ext["full_range"] = full_range
    weight["ext"] = ext
    return copied


def resolved_grid(config: dict[str, Any]) -> bool:
    """Whether a GPTQ config's modules use the full_range grid (its qconfig's width)."""
    from msquant.plugin import QDType
    from msquant.processors.methods.gptq import GPTQExt

    weight = weight_of(config)
    bits = QDType(weight.get("dtype", "int8")).bits
    return GPTQExt.model_validate(weight.get("ext") or {}).resolved_full_range(bits)


def effective_options(config: dict[str, Any]) -> tuple[Any, ...]:
    """What decides a GPTQ run's numbers (the scheme and resolved options, not the saver)."""
    from msquant.processors.methods.gptq import GPTQExt

    weight = weight_of(config)
    ext = GPTQExt.model_validate(weight.get("ext") or {})
    bits = 4 if weight.get("dtype") == "int4" else 8
    return (
        weight.get("dtype", "int8"), weight.get("scope", "per_channel"), weight.get("symmetric", True),
        ext.group_size if weight.get("scope") == "per_group" else None, ext.percdamp,
        ext.block_size, ext.resolved_desc_act(), ext.resolved_static_groups(),
        ext.resolved_full_range(bits), ext.resolved_calib_inputs(), ext.resolved_true_sequential(),
        ext.resolved_mse(bits),
    )  # fmt: skip


def prepare_texts(
    model_dir: Path, calib_samples: int, eval_samples: int, seqlen: int, tmp: Path
) -> Texts:
    """Calibration windows (a .jsonl file, decoded windows) and the held-out token streams."""
    import torch

    from msquant.load.calibration import read_calibration_texts, tokenize_samples
    from msquant.load.model_folder import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    sources = eval_texts.find_sources()
    articles = [text for _, text in eval_texts.wiki_articles(sources.wiki)]
    calib_side, held_side = eval_texts.split_articles(articles)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    windows = eval_texts.token_windows(calib_side, encode, calib_samples, seqlen)
    calib_path = tmp / "calib_wiki.jsonl"
    with calib_path.open("w", encoding="utf-8") as handle:
        for window in windows:
            handle.write(json.dumps({"text": tokenizer.decode(window)}) + "\n")
    # The exact ids msquant calibrates on (decoded windows re-tokenized, cut at seqlen).
    calib_ids = [
        s[0].tolist()
        for s in tokenize_samples(read_calibration_texts(calib_path), tokenizer, seqlen)
    ]
    held_out = {}
    news = eval_texts.news_articles(sources.news)
    for name, texts in (("wiki", held_side), ("news", news)):
        stream = eval_texts.token_windows(texts, encode, eval_samples, seqlen)
        held_out[name] = torch.tensor([i for w in stream for i in w], dtype=torch.long)
    return Texts(calib_path, calib_ids, held_out)


def perplexities(model_dir: Path, texts: Texts, seqlen: int) -> dict[str, float]:
    """Perplexity of a float folder or an export, read back as ``msquant eval`` does."""
    from msquant.evaluate.models import load_model_for_eval
    from msquant.evaluate.windows import measure_perplexity

    model, _ = load_model_for_eval(model_dir)
    return {
        name: measure_perplexity(model, ids, seqlen).ppl for name, ids in texts.held_out.items()
    }


def quantize(
    model_dir: Path, config: dict[str, Any], texts: Texts, out: Path, seqlen: int
) -> float:
    """Run ``msquant.quantize`` as the CLI does (checkpoints, read-back check); its wall time."""
    import msquant

    started = time.perf_counter()
    msquant.quantize(
        model_dir, out, config, calib_path=texts.calib_path, max_calib_tokens=seqlen,
        progress=False, overwrite=True,
    )  # fmt: skip
    return time.perf_counter() - started


def run_llmcompressor(
    python: Path, model_dir: Path, texts: Texts, out: Path, group_size: int
) -> float:
    """llm-compressor's oneshot GPTQ (its defaults, int4 group sym) in its own venv; wall time
    of the oneshot call and the save, as the script reports it."""
    ids_file = out.parent / "calib_ids.json"
    ids_file.write_text(json.dumps(texts.calib_ids))
    result = subprocess.run(
        [str(python), str(LLMCOMPRESSOR_SCRIPT), "--model_dir", str(model_dir), "--ids", str(ids_file),
         "--out", str(out), "--group_size", str(group_size)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"llm-compressor failed:\n{result.stderr[-3000:]}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["seconds"])


def render(rows: Sequence[Row], float_ppl: dict[str, float]) -> list[str]:
    """The table: perplexities, increases over float, and a quantized model's increase as a
    fraction of round-to-nearest's: ``/RTN`` against rounding on the same grid, ``/RTNms``
    against rounding on msModelSlim's grid (``method: minmax``'s default)."""
    names = list(float_ppl)
    head = " ".join(f"{n + ' ppl':>10} {'incr':>8} {'/RTN':>5} {'/RTNms':>6}" for n in names)
    lines = [f"{'model':<44} {head} {'time':>8}"]
    lines.append(
        f"{'float':<44} "
        + " ".join(f"{float_ppl[n]:>10.3f} {'':>8} {'':>5} {'':>6}" for n in names)
    )
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            lines.append(f"-- {section}")
        if not row.ppl:
            lines.append(f"{row.name:<44} {row.note}")
            continue
        rtns = [r for r in rows if r.section == row.section and r.rtn and r.ppl]
        same = next((r for r in rtns if r.grid_full_range == row.grid_full_range), None)
        restricted = next((r for r in rtns if not r.grid_full_range), None)
        cells = []
        for n in names:
            increase = row.ppl[n] / float_ppl[n] - 1
            fractions = []
            for rtn, width in ((same, 5), (restricted, 6)):
                text = ""
                if rtn is not None and not row.rtn:
                    text = f"{increase / (rtn.ppl[n] / float_ppl[n] - 1):.2f}"
                fractions.append(f"{text:>{width}}")
            cells.append(f"{row.ppl[n]:>10.3f} {increase:>+8.2%} " + " ".join(fractions))
        seconds = "" if row.seconds is None else f"{row.seconds:>7.1f}s"
        note = f"  {row.note}" if row.note else ""
        lines.append(f"{row.name:<44} " + " ".join(cells) + f" {seconds:>8}{note}")
    return lines


def render_files(paths: Sequence[Path]) -> list[str]:
    """One table from the ``--json`` files of several runs (same texts and settings)."""
    rows: list[Row] = []
    float_ppl: dict[str, float] = {}
    for path in paths:
        data = json.loads(path.read_text())
        float_ppl = float_ppl or data["float"]
        if data["float"] != float_ppl:
            raise SystemExit(f"{path}: measured on other texts or settings (float perplexity)")
        rows += [Row(**row) for row in data["rows"]]
    order = list(dict.fromkeys(row.section for row in rows))
    rows.sort(key=lambda row: order.index(row.section))
    return render(rows, float_ppl)


def parse_variants(values: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """``NAME=JSON`` pairs: extra W4 rows, the default YAML with these ``ext`` keys."""
    variants = []
    for value in values:
        name, _, options = value.partition("=")
        variants.append((name, json.loads(options)))
    return variants


@dataclass
class Bench:
    """Runs configs, measures their exports and collects the rows."""

    model_dir: Path
    texts: Texts
    seqlen: int
    tmp: Path
    float_ppl: dict[str, float]
    rows: list[Row] = field(default_factory=list)
    seen: dict[tuple[Any, ...], str] = field(default_factory=dict)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print("\n".join(render([row], self.float_ppl)[2:]), flush=True)

    def measure(self, section: str, name: str, config: dict[str, Any], rtn: bool = False) -> None:
        """Quantize with ``config``, read the export back, evaluate it (a GPTQ config whose
        options equal an earlier row's is not run twice)."""
        if not rtn:
            key = (section, effective_options(config))
            if key in self.seen:
                self.rows.append(
                    Row(section, name, note=f"same options as '{self.seen[key]}' (not run twice)")
                )
                return
            self.seen[key] = name
        out = self.tmp / f"out{len(self.rows)}"
        seconds = quantize(self.model_dir, config, self.texts, out, self.seqlen)
        export = out / "compressed_tensors" if (out / "compressed_tensors").is_dir() else out
        ext = weight_of(config).get("ext") or {}
        grid = bool(ext.get("full_range")) if rtn else resolved_grid(config)
        ppl = perplexities(export, self.texts, self.seqlen)
        self.add(Row(section, name, ppl, seconds, grid, rtn))


def run_w4(
    bench: Bench,
    skip: set[str],
    variants: Sequence[tuple[str, dict[str, Any]]],
    llmcompressor_python: Path | None,
) -> None:
    """The W4 rows: rounding on both grids, the default YAML, the example, msModelSlim's
    numerics, extra variants, llm-compressor."""
    section = "W4A16 int4 group 64 sym"
    if "rtn" not in skip:
        for full_range, grid in ((False, "msModelSlim grid (-7..7)"), (True, "full_range (-8..7)")):
            bench.measure(
                section, f"round-to-nearest, {grid}", as_minmax(DEFAULT_W4, full_range), rtn=True
            )
    if "default" not in skip:
        bench.measure(section, "GPTQ, default YAML", DEFAULT_W4)
        example = yaml.safe_load(W4_EXAMPLE.read_text())
        bench.measure(section, f"GPTQ, {W4_EXAMPLE.name}", example)
    if "msmodelslim" not in skip:
        msmodelslim = with_ext(DEFAULT_W4, numerics="msmodelslim")
        bench.measure(section, "GPTQ, numerics: msmodelslim", msmodelslim)
    for name, ext in variants:
        bench.measure(section, f"GPTQ, {name}", with_ext(DEFAULT_W4, **ext))
    if "llmcompressor" not in skip and llmcompressor_python is not None:
        out = bench.tmp / "llmcompressor"
        seconds = run_llmcompressor(llmcompressor_python, bench.model_dir, bench.texts, out, 64)
        ppl = perplexities(out, bench.texts, bench.seqlen)
        bench.add(Row(section, "llm-compressor 0.14 GPTQ (its defaults)", ppl, seconds, True))


def run_w8(bench: Bench, skip: set[str]) -> None:
    """The W8 rows: the rounding example, the GPTQ example, msModelSlim's numerics."""
    section = "W8A16 int8 per-channel sym"
    if "rtn" not in skip:
        rtn = yaml.safe_load(W8_RTN_EXAMPLE.read_text())
        bench.measure(section, f"round-to-nearest, {W8_RTN_EXAMPLE.name}", rtn, rtn=True)
    example = yaml.safe_load(W8_EXAMPLE.read_text())
    bench.measure(section, f"GPTQ, {W8_EXAMPLE.name}", example)
    if "msmodelslim" not in skip:
        bench.measure(
            section, "GPTQ, numerics: msmodelslim", with_ext(example, numerics="msmodelslim")
        )


def float_perplexities(args: argparse.Namespace, texts: Texts) -> dict[str, float]:
    """The float model's perplexities, read from ``--float_cache`` when it holds them for the
    same settings (the float model is deterministic), else measured (and cached there)."""
    key = f"{args.model_dir.resolve()}|{args.calib_samples}|{args.eval_samples}|{args.seqlen}"
    cache = args.float_cache
    if cache is not None and cache.is_file():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return dict(stored["ppl"])
    ppl = perplexities(args.model_dir, texts, args.seqlen)
    if cache is not None:
        cache.write_text(json.dumps({"key": key, "ppl": ppl}))
    return ppl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--calib_samples", type=int, default=64)
    parser.add_argument("--eval_samples", type=int, default=20)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument(
        "--skip",
        default="",
        help="comma list of: w4, w8, default (the W4 default and example rows), llmcompressor, msmodelslim, rtn",
    )
    parser.add_argument("--only", default="", help="comma list of sections to run: w4, w8")
    parser.add_argument(
        "--variant", action="append", default=[], help='extra W4 GPTQ row: NAME={"ext_key": value}'
    )
    parser.add_argument(
        "--llmcompressor_python", type=Path,
        default=LLMCOMPRESSOR_PYTHON if LLMCOMPRESSOR_PYTHON.exists() else None,
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--float_cache", type=Path, help="keep the float model's perplexities here across runs"
    )
    parser.add_argument(
        "--render", type=Path, nargs="+", help="only print one table from these --json files"
    )
    args = parser.parse_args()
    if args.render:
        print("\n".join(render_files(args.render)))
        return 0
    if not (args.model_dir / "config.json").is_file():
        print(
            f"{args.model_dir} is not prepared: run scripts/prepare_smollm2.py first",
            file=sys.stderr,
        )
        return 2
    try:
        eval_texts.find_sources()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    import torch

    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(","))) or {"w4", "w8"}
    sections = [s for s in ("w4", "w8") if s in only and s not in skip]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model_dir.name}"
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        texts = prepare_texts(
            args.model_dir, args.calib_samples, args.eval_samples, args.seqlen, tmp
        )
        print(
            f"calibration {len(texts.calib_ids)} x {args.seqlen} tokens of Wikipedia (even "
            f"articles); held-out {args.eval_samples} x {args.seqlen} tokens of Wikipedia (odd "
            "articles) and of news"
        )
        started = time.perf_counter()
        float_ppl = float_perplexities(args, texts)
        print(f"float model evaluated in {time.perf_counter() - started:.0f} s", flush=True)
        bench = Bench(args.model_dir, texts, args.seqlen, tmp, float_ppl)
        if "w4" in sections:
            run_w4(bench, skip, parse_variants(args.variant), args.llmcompressor_python)
        if "w8" in sections:
            run_w8(bench, skip)
        rows = bench.rows
    print()
    print("\n".join(render(rows, float_ppl)))
    print("incr: perplexity increase over float; /RTN: that increase over round-to-nearest's on the "
          "same grid; time: the whole quantization run (model load, calibration, solves, export, "
          "read-back check)")  # fmt: skip
    if args.json is not None:
        args.json.write_text(
            json.dumps({"float": float_ppl, "rows": [r.__dict__ for r in rows]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
