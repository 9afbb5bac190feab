"""The alpha/beta search of ``flex_smooth_quant`` alone: the shared search
(:class:`msquant.quant.smoothing.SmoothingSearch`, what runs) against the plain definition (every
candidate through :func:`msquant.quant.smoothing.smoothing_error`), interleaved subgraph by
subgraph on the rows the search sees in a real run, with their answers compared (docs/accuracy.md,
"Smoothing").

The rows come from a ``flex_smooth_quant`` + W8A8_DYNAMIC run of the model's first ``--layers``
decoder layers (a copy of the model folder with fewer layers, written under ``--work``) on the
bench's calibration texts (``python bench/activation_texts.py DIR``).

Usage::

    python bench/smoothing_search.py --model_dir models/SmolLM2-135M-Instruct --texts /tmp/texts \\
        [--layers 3] [--work /tmp/smoothing_search]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import msquant
import msquant.processors.smoothing.folding as folding
from msquant.quant.smoothing import SEARCH_STEP, search_alpha_beta, smoothing_error

REPO = Path(__file__).resolve().parents[1]
Search = Callable[[torch.Tensor, torch.Tensor], tuple[float, float, float]]
#: the search grid 0, 0.05, ..., 1
GRID = [round(i * SEARCH_STEP, 2) for i in range(round(1 / SEARCH_STEP) + 1)]


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
            max_calib_tokens=512,
            progress=False,
        )
    finally:
        folding.search_alpha_beta = real
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=REPO / "models/SmolLM2-135M-Instruct")
    parser.add_argument("--texts", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/smoothing_search"))
    args = parser.parse_args()
    model = truncated_model(args.model_dir, args.layers, args.work / "model")
    cases = recorded_searches(model, args.texts, args.work / "export")
    searches: dict[str, Search] = {"one by one": one_by_one, "shared": search_alpha_beta}
    totals = {name: [0.0, 0.0] for name in searches}
    for act, weight in cases:
        answers = []
        for name, search in searches.items():
            wall, cpu = time.perf_counter(), time.process_time()
            answers.append(search(act, weight))
            totals[name][0] += time.perf_counter() - wall
            totals[name][1] += time.process_time() - cpu
        if answers[0] != answers[1]:
            raise SystemExit(f"the searches disagree on {tuple(weight.shape)}: {answers}")
    rows = ", ".join(str(act.shape[0]) for act, _ in cases[:1])
    print(f"{len(cases)} searches ({args.layers} layers, {rows} rows each), same answers")
    for name, (wall, cpu) in totals.items():
        print(f"{name:<12} wall {wall:8.1f} s   process CPU {cpu:8.1f} s")


if __name__ == "__main__":
    main()
