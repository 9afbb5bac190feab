"""The alpha/beta search of ``flex_smooth_quant`` alone, on the rows it sees in a real run: the
screened search (:func:`msquant.quant.smoothing.search_alpha_beta`, what runs) against every
candidate computed (:class:`msquant.quant.smoothing.SmoothingSearch`, the search before the
screen) and against one bare forward of the same layers over the same calibration samples; the
answers are also checked against the plain definition (every candidate through
:func:`msquant.quant.smoothing.smoothing_error`) (docs/performance.md, "flex_smooth_quant's
search").

With ``--baseline FILE`` (a ``msquant/quant/smoothing.py`` of another commit, e.g. ``git show
main:msquant/quant/smoothing.py > /tmp/main_smoothing.py``) that file's ``search_alpha_beta`` is
timed too, interleaved, and its answers checked equal. The screen's work is counted: int8 row
blocks (in whole products) and float32 products (the objective, and the reference) per search.

The rows come from a ``flex_smooth_quant`` + W8A8_DYNAMIC run of the model's first ``--layers``
decoder layers (a copy of the model folder with fewer layers, written under ``--work``) on the
bench's calibration texts (``python bench/activation_texts.py DIR``). The three are timed
interleaved, ``--rounds`` times (the order rotating), and their minimum and median printed with
the machine's load average: the machine may be shared.

Usage::

    python bench/smoothing_search.py --model_dir models/SmolLM2-135M-Instruct --texts /tmp/texts \\
        [--layers 3] [--rounds 5] [--work /tmp/smoothing_search] [--baseline FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import msquant
import msquant.processors.smoothing.folding as folding
from msquant.quant import smoothing
from msquant.quant.smoothing import (
    SEARCH_STEP,
    SmoothingSearch,
    search_alpha_beta,
    smoothing_error,
)

REPO = Path(__file__).resolve().parents[1]
Search = Callable[[torch.Tensor, torch.Tensor], tuple[float, float, float]]
#: the search grid 0, 0.05, ..., 1
GRID = [round(i * SEARCH_STEP, 2) for i in range(round(1 / SEARCH_STEP) + 1)]
MAX_CALIB_TOKENS = 512


def one_by_one(act: torch.Tensor, weight: torch.Tensor) -> tuple[float, float, float]:
    """The two sweeps with every candidate through smoothing_error (the plain definition)."""
    reference = act @ weight.T
    best_alpha, best = 0.0, float("inf")
    for alpha in GRID:
        error = smoothing_error(act, weight, alpha, 1.0 - alpha, reference)
        if error <= best:
            best_alpha, best = alpha, error
    best_beta = 0.0
    for beta in GRID:
        error = smoothing_error(act, weight, best_alpha, beta, reference)
        if error <= best:
            best_beta, best = beta, error
    return best_alpha, best_beta, best


def every_candidate(act: torch.Tensor, weight: torch.Tensor) -> tuple[float, float, float]:
    """The two sweeps with every candidate computed by one SmoothingSearch (the search before the
    screen: shared statistics and buffers, 41 float products)."""
    search = SmoothingSearch(act, weight)
    best_alpha, best = 0.0, float("inf")
    for alpha in GRID:
        error = search.error(alpha, 1.0 - alpha)
        if error <= best:
            best_alpha, best = alpha, error
    best_beta = 0.0
    for beta in GRID:
        error = search.error(best_alpha, beta)
        if error <= best:
            best_beta, best = beta, error
    return best_alpha, best_beta, best


def bare_forward(model: Path, texts: Path) -> Callable[[], None]:
    """One float32 forward of ``model`` over the run's calibration samples (each on its own, cut
    at 512 tokens as the run's ``max_calib_tokens``), as a callable to time."""
    from transformers import AutoModelForCausalLM

    from msquant.load.calibration import read_calibration_texts, tokenize_samples
    from msquant.load.model_folder import load_tokenizer

    samples = tokenize_samples(
        read_calibration_texts(texts / "calib.txt"), load_tokenizer(model), MAX_CALIB_TOKENS
    )
    network = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def forward() -> None:
        with torch.no_grad():
            for ids in samples:
                network(input_ids=ids, use_cache=False)

    return forward


def truncated_model(model_dir: Path, layers: int, out: Path) -> Path:
    """A copy of a single-file safetensors model folder keeping its first ``layers`` layers."""
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = load_file(str(model_dir / "model.safetensors"))
    kept = {
        name: t
        for name, t in tensors.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def recorded_searches(model: Path, texts: Path, save: Path) -> list[tuple[torch.Tensor, ...]]:
    """The (rows, weight) pairs the search sees in a flex_smooth_quant run of ``model``."""
    seen: list[tuple[torch.Tensor, ...]] = []
    real = folding.search_alpha_beta

    def record(act: torch.Tensor, weight: torch.Tensor) -> tuple[float, float, float]:
        seen.append((act.clone(), weight.clone()))
        return real(act, weight)

    folding.search_alpha_beta = record
    try:
        shutil.rmtree(save, ignore_errors=True)
        msquant.quantize(
            model,
            save,
            REPO / "yaml_examples" / "w8a8_dynamic_flex_smooth.yaml",
            calib_path=texts / "calib.txt",
            max_calib_tokens=MAX_CALIB_TOKENS,
            progress=False,
        )
    finally:
        folding.search_alpha_beta = real
    return seen


def baseline_search(path: Path) -> Search:
    """``search_alpha_beta`` of a copy of ``msquant/quant/smoothing.py`` (another commit's)."""
    spec = importlib.util.spec_from_file_location("baseline_smoothing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    search: Search = module.search_alpha_beta
    return search


def screen_work(cases: list[tuple[torch.Tensor, ...]]) -> tuple[float, float]:
    """The screened search's work per search: int8 row blocks, in whole products (a block is
    ``1 / SCREEN_BLOCKS`` of the larger operand's rows), and float32 products (the objective of
    the candidates the screen keeps, plus the reference)."""
    blocks, computed = 0.0, 0
    next_block, compute = SmoothingSearch._next_block, SmoothingSearch._compute

    def counting_block(self: SmoothingSearch, progress: object) -> None:
        nonlocal blocks
        blocks += 1 / len(self._blocked)
        next_block(self, progress)  # type: ignore[arg-type]

    def counting_compute(self: SmoothingSearch, alpha: float, beta: float) -> float:
        nonlocal computed
        computed += 1
        return compute(self, alpha, beta)

    SmoothingSearch._next_block = counting_block  # type: ignore[method-assign]
    SmoothingSearch._compute = counting_compute  # type: ignore[method-assign]
    try:
        for act, weight in cases:
            search_alpha_beta(act, weight)
    finally:
        SmoothingSearch._next_block = next_block  # type: ignore[method-assign]
        SmoothingSearch._compute = compute  # type: ignore[method-assign]
    return blocks / len(cases), computed / len(cases) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--texts", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/smoothing_search"))
    parser.add_argument("--baseline", type=Path, help="a smoothing.py to time against")
    args = parser.parse_args()
    baseline = baseline_search(args.baseline) if args.baseline else None
    model = truncated_model(args.model_dir, args.layers, args.work / "model")
    cases = recorded_searches(model, args.texts, args.work / "export")
    for act, weight in cases:
        answers = {search_alpha_beta(act, weight), every_candidate(act, weight)}
        if baseline is not None:
            answers.add(baseline(act, weight))
        if answers != {one_by_one(act, weight)}:
            raise SystemExit(f"the searches disagree on {tuple(weight.shape)}: {answers}")
    forward = bare_forward(model, args.texts)

    def searching(search: Search) -> Callable[[], None]:
        def run() -> None:
            for act, weight in cases:
                search(act, weight)

        return run

    timed = {
        "screened": searching(search_alpha_beta),
        "every candidate": searching(every_candidate),
        "bare forward": forward,
    }
    if baseline is not None:
        timed["baseline"] = searching(baseline)
    times: dict[str, list[float]] = {name: [] for name in timed}
    cpu: dict[str, list[float]] = {name: [] for name in timed}
    names = list(timed)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            timed[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    rows = cases[0][0].shape[0]
    print(
        f"{len(cases)} searches ({args.layers} layers, {rows} rows each), same answers as every "
        f"candidate through smoothing_error; {args.rounds} rounds, torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} (end)"
    )
    blocks, products = screen_work(cases)
    print(
        f"screened: {blocks:.1f} int8 products (in row blocks of 1/{smoothing.SCREEN_BLOCKS}) and "
        f"{products:.2f} float32 products per search (every candidate: 0 and 42)"
    )
    for name, values in times.items():
        print(
            f"{name:<16} min {min(values):7.2f} s   median {statistics.median(values):7.2f} s   "
            f"process CPU min {min(cpu[name]):7.2f} s   median {statistics.median(cpu[name]):7.2f} s"
        )
    pairs: tuple[tuple[str, str], ...] = (
        ("screened", "every candidate"),
        ("screened", "bare forward"),
    )
    if baseline is not None:
        pairs = (("screened", "baseline"), *pairs)
    for a, b in (*pairs, ("every candidate", "bare forward")):
        ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
        print(
            f"{a} / {b}: min {min(ratios):.3f}  median {statistics.median(ratios):.3f} "
            f"(per round); {min(times[a]) / min(times[b]):.3f} (min / min); process CPU "
            f"{min(cpu[a]) / min(cpu[b]):.3f} (min / min)"
        )


if __name__ == "__main__":
    main()
