"""End-to-end bench: msquant against llm-compressor on the same calibration tokens, interleaved.

For each calibration size (``--sizes``, default ``8x256,64x512``: samples x tokens) and scheme
(``--schemes``):

* ``w4_gptq``: msquant's ``yaml_examples/w4a16_per_group64_gptq_compressed_tensors.yaml`` against
  llm-compressor's GPTQModifier with the same int4 group-64 symmetric scheme (its defaults
  otherwise, ``bench/llmcompressor_oneshot.py``);
* ``w8a8_smooth``: msquant's ``yaml_examples/w8a8_dynamic_flex_smooth.yaml`` (W8A8_DYNAMIC after
  ``flex_smooth_quant``) against llm-compressor's SmoothQuantModifier + int8 per-channel weights
  and int8 dynamic per-token activations;

it runs, ``--rounds`` times with the order rotating, each tool as a user runs it: a fresh process
(``python -m msquant quant ...``, msquant's defaults: checkpoints and the export's read-back check
included; llm-compressor's ``oneshot`` and ``save_pretrained``), timed from process start to exit,
plus the floor: one process that loads the float model and runs the bare calibration forward over
the same tokens, and the same forward accumulating every linear's ``X^T X`` (the Hessians GPTQ
needs). The load average is recorded before every process. It prints min / median / max of each,
and the ratios of the medians: msquant / llm-compressor, and msquant's layer loop (from its
``quant_report.json``: every decoder layer's seconds) against the floor, which is the bare
forward with Hessians plus msquant's own GPTQ solves (``solve_seconds``) for ``w4_gptq`` and the
bare forward for ``w8a8_smooth``.

Calibration windows are cut from encyclopedia text (``bench/eval_texts.py``: the Wikipedia dump
gensim ships as test data) exactly as bench/accuracy.py cuts them; both tools get the same token
ids. With ``--ppl`` the last round's exports are read back by ``msquant eval``'s reader and
scored on held-out text (``--eval_samples`` x the size's tokens), so the ratio comes with the
perplexities it bought.

llm-compressor runs in its own virtual environment (``--llmcompressor_python``, default
``/work/venvs/llmcompressor/bin/python``; see bench/accuracy.py for how to make it)::

    pip install --no-deps gensim==4.4.0
    python scripts/prepare_smollm2.py models/SmolLM2-135M-Instruct
    python bench/e2e.py --model_dir models/SmolLM2-135M-Instruct [--sizes 8x256] \\
        [--schemes w4_gptq] [--rounds 3] [--ppl] [--json out.json] \\
        [--variant 'float_inputs={"calib_inputs": "float"}'] [--tools msquant,llm-compressor]

``--variant NAME=JSON`` adds a tool ``msquant NAME``: the scheme's YAML with these keys merged into
every ``linear_quant`` entry's ``qconfig.weight.ext`` (an option a user can set, timed and scored
beside the defaults, e.g. the one-forward-per-layer calibration ``calib_inputs: float``).
``--tools`` keeps some of ``msquant``, ``llm-compressor``, ``floor`` (all by default; the floor
ratios are printed only when the floor ran).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "yaml_examples"
LLMCOMPRESSOR_PYTHON = Path("/work/venvs/llmcompressor/bin/python")
LLMCOMPRESSOR_SCRIPT = Path(__file__).resolve().parent / "llmcompressor_oneshot.py"

#: scheme -> (msquant's YAML, llm-compressor's --scheme)
SCHEMES: dict[str, tuple[Path, str]] = {
    "w4_gptq": (EXAMPLES / "w4a16_per_group64_gptq_compressed_tensors.yaml", "w4_gptq"),
    "w8a8_smooth": (EXAMPLES / "w8a8_dynamic_flex_smooth.yaml", "w8a8_smoothquant"),
}


@dataclass
class Timing:
    """One timed process."""

    seconds: float
    load_before: float
    details: dict[str, float] = field(default_factory=dict)


@dataclass
class Cell:
    """Every round of one tool on one (size, scheme)."""

    tool: str
    timings: list[Timing] = field(default_factory=list)
    ppl: dict[str, float] = field(default_factory=dict)

    def values(self, key: str = "seconds") -> list[float]:
        if key == "seconds":
            return [t.seconds for t in self.timings]
        return [t.details[key] for t in self.timings if key in t.details]

    def median(self, key: str = "seconds") -> float:
        return statistics.median(self.values(key))


def load_average() -> float:
    """The 1-minute load average (how busy the machine was when a process started)."""
    return os.getloadavg()[0]


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Run ``command``; (wall seconds, load average before, stdout). Raises on failure."""
    load = load_average()
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{command[:4]} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return seconds, load, result.stdout


def variant_config(config: Path, ext: dict[str, Any], out: Path) -> Path:
    """``config`` with ``ext`` merged into every ``linear_quant`` entry's weight ``ext``,
    written to ``out``."""
    import yaml

    data = yaml.safe_load(config.read_text())
    for entry in data["spec"]["process"]:
        if entry.get("type") == "linear_quant":
            weight = entry["qconfig"]["weight"]
            weight["ext"] = {**(weight.get("ext") or {}), **ext}
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def run_msquant(model_dir: Path, config: Path, calib: Path, seqlen: int, out: Path) -> Timing:
    """msquant's CLI as a user runs it; the layer loop and solves from its run report."""
    seconds, load, _ = timed(
        [sys.executable, "-m", "msquant", "quant", "--model_path", str(model_dir),
         "--config_path", str(config), "--calib_path", str(calib), "--save_path", str(out),
         "--max_calib_tokens", str(seqlen), "--no_progress", "--overwrite"],
    )  # fmt: skip
    report = json.loads(next(out.rglob("quant_report.json")).read_text())
    details = {
        "layer_loop": sum(layer["seconds"] for layer in report["layers"]),
        "solves": sum(m.get("solve_seconds") or 0.0 for m in report["modules"]),
        "run": float(report["total_seconds"]),
    }
    return Timing(seconds, load, details)


def run_llmcompressor(python: Path, model_dir: Path, ids: Path, scheme: str, out: Path) -> Timing:
    """llm-compressor's oneshot and save in its own environment."""
    seconds, load, stdout = timed(
        [str(python), str(LLMCOMPRESSOR_SCRIPT), "--model_dir", str(model_dir), "--ids", str(ids),
         "--out", str(out), "--scheme", scheme],
    )  # fmt: skip
    inner = json.loads(stdout.strip().splitlines()[-1])
    return Timing(seconds, load, {"oneshot": float(inner["oneshot_seconds"])})


def run_floor(model_dir: Path, ids: Path) -> Timing:
    """The floor process (``--floor``): bare forward, and forward with Hessians."""
    seconds, load, stdout = timed(
        [sys.executable, str(Path(__file__).resolve()), "--floor", "--model_dir", str(model_dir),
         "--floor_ids", str(ids)],
    )  # fmt: skip
    return Timing(seconds, load, {k: float(v) for k, v in json.loads(stdout).items()})


def floor(model_dir: Path, ids_file: Path) -> dict[str, float]:
    """Time the bare float32 calibration forward over ``ids_file``'s samples (one at a time, as
    both tools calibrate), then the same forward with ``X^T X`` accumulated in float32 once per
    distinct linear input (q/k/v and gate/up share theirs): what GPTQ's Hessians cost at least."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = json.loads(ids_file.read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = [torch.tensor([x], dtype=torch.long) for x in ids]
    decoder = model.model  # the decoder stack without the head: both tools skip lm_head

    def forward() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for sample in samples:
                decoder(input_ids=sample, use_cache=False)
        return time.perf_counter() - started

    forward()  # warm-up (allocator, kernels), not counted
    bare = forward()
    hessians: dict[str, torch.Tensor] = {}
    # inputs already accumulated in this decoder layer (q/k/v share theirs), held so that their
    # memory is not reused by a later input of the same layer
    seen: dict[int, torch.Tensor] = {}

    def accumulate(name: str):  # type: ignore[no-untyped-def]
        def hook(module, inputs, output):  # type: ignore[no-untyped-def]
            if inputs[0].data_ptr() in seen:
                return
            seen[inputs[0].data_ptr()] = inputs[0]
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            if name not in hessians:
                hessians[name] = torch.zeros(x.shape[1], x.shape[1])
            hessians[name].addmm_(x.t(), x)

        return hook

    def clear_seen(module, args, output):  # type: ignore[no-untyped-def]
        seen.clear()  # after each decoder layer: its buffers may be reused by the next

    handles = [
        module.register_forward_hook(accumulate(name))
        for name, module in decoder.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    handles += [layer.register_forward_hook(clear_seen) for layer in decoder.layers]
    with_hessians = forward()
    for handle in handles:
        handle.remove()
    return {"forward": bare, "forward_hessians": with_hessians}


@dataclass
class Case:
    """One (size, scheme): what each tool's process is given."""

    model_dir: Path
    config: Path
    llmcompressor_scheme: str
    calib: Path
    ids: Path
    seqlen: int
    work: Path
    llmcompressor_python: Path | None
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)

    def out(self, tool: str) -> Path:
        return self.work / tool.replace(" ", "_")

    def run(self, tool: str) -> Timing:
        if tool == "msquant":
            return run_msquant(self.model_dir, self.config, self.calib, self.seqlen, self.out(tool))
        if tool.startswith("msquant "):
            name = tool.removeprefix("msquant ")
            config = variant_config(self.config, self.variants[name], self.work / f"{name}.yaml")
            return run_msquant(self.model_dir, config, self.calib, self.seqlen, self.out(tool))
        if tool == "llm-compressor":
            assert self.llmcompressor_python is not None
            return run_llmcompressor(
                self.llmcompressor_python, self.model_dir, self.ids, self.llmcompressor_scheme,
                self.out(tool),
            )  # fmt: skip
        return run_floor(self.model_dir, self.ids)


def perplexities(export: Path, texts: Any, seqlen: int) -> dict[str, float]:
    """Held-out perplexity of an export read back as ``msquant eval`` does."""
    import accuracy

    return accuracy.perplexities(export, texts, seqlen)


def summary(values: list[float]) -> str:
    return f"{min(values):7.1f} {statistics.median(values):7.1f} {max(values):7.1f}"


def report(size: str, scheme: str, cells: dict[str, Cell]) -> list[str]:
    """The table of one (size, scheme) and its ratios."""
    lines = [f"== {scheme} at {size} (seconds: min median max; load average before each run)"]
    for cell in cells.values():
        loads = ", ".join(f"{t.load_before:.1f}" for t in cell.timings)
        lines.append(f"{cell.tool:<16} {summary(cell.values())}   load {loads}")
        for key in sorted(cell.timings[0].details):
            lines.append(f"  {key:<14} {summary(cell.values(key))}")
        if cell.ppl:
            lines.append("  ppl " + ", ".join(f"{k} {v:.3f}" for k, v in cell.ppl.items()))
    lc, fl = cells.get("llm-compressor"), cells.get("floor")
    msquants = [cell for tool, cell in cells.items() if tool.startswith("msquant")]
    if lc is not None:
        for cell in msquants:
            lines.append(
                f"{cell.tool} / llm-compressor (median end to end): "
                f"{cell.median() / lc.median():.2f}"
            )
    ms = cells.get("msquant")
    if ms is None or fl is None:
        return lines
    if scheme == "w4_gptq":
        floor_seconds = fl.median("forward_hessians") + ms.median("solves")
        lines.append(
            f"msquant layer loop / floor (forward with Hessians {fl.median('forward_hessians'):.1f} s"
            f" + solves {ms.median('solves'):.1f} s): {ms.median('layer_loop') / floor_seconds:.2f}"
        )
    else:
        lines.append(
            f"msquant layer loop / bare calibration forward ({fl.median('forward'):.1f} s): "
            f"{ms.median('layer_loop') / fl.median('forward'):.2f}; end to end / bare forward: "
            f"{ms.median() / fl.median('forward'):.2f}"
        )
    return lines


def parse_size(text: str) -> tuple[int, int]:
    samples, _, seqlen = text.partition("x")
    return int(samples), int(seqlen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, default=REPO / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--sizes", default="8x256,64x512")
    parser.add_argument("--schemes", default="w4_gptq,w8a8_smooth")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llmcompressor_python", type=Path, default=LLMCOMPRESSOR_PYTHON)
    parser.add_argument("--ppl", action="store_true", help="score the last round's exports")
    parser.add_argument("--eval_samples", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write every timing here")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also run msquant with these linear_quant ext keys",
    )
    parser.add_argument(
        "--tools",
        default="msquant,llm-compressor,floor",
        help="comma list of msquant, llm-compressor, floor",
    )
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--floor_ids", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor:
        print(json.dumps(floor(args.model_dir, args.floor_ids)))
        return 0
    if not (args.model_dir / "config.json").is_file():
        print(f"{args.model_dir} is not prepared: run scripts/prepare_smollm2.py", file=sys.stderr)
        return 2
    llmcompressor = args.llmcompressor_python if args.llmcompressor_python.is_file() else None
    if llmcompressor is None:
        print(f"no llm-compressor at {args.llmcompressor_python}: its column is left out")
    import accuracy

    tools = set(args.tools.split(","))
    variants = dict(accuracy.parse_variants(args.variant))  # NAME=JSON, as accuracy.py's
    results: dict[str, Any] = {}
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for size in args.sizes.split(","):
            samples, seqlen = parse_size(size)
            work = tmp / size
            work.mkdir()
            texts = accuracy.prepare_texts(args.model_dir, samples, args.eval_samples, seqlen, work)
            ids = work / "calib_ids.json"
            ids.write_text(json.dumps(texts.calib_ids))
            for scheme in args.schemes.split(","):
                config, lc_scheme = SCHEMES[scheme]
                names = ["msquant", *(f"msquant {name}" for name in variants), "floor"]
                if llmcompressor is not None:
                    names.append("llm-compressor")
                cells = {name: Cell(name) for name in names if name.split(" ")[0] in tools}
                case = Case(args.model_dir, config, lc_scheme, texts.calib_path, ids, seqlen,
                            work / scheme, llmcompressor, variants)  # fmt: skip
                case.work.mkdir()
                order = list(cells)
                for round_ in range(args.rounds):
                    for tool in order[round_ % len(order) :] + order[: round_ % len(order)]:
                        cells[tool].timings.append(case.run(tool))
                        print(f"{size} {scheme} round {round_ + 1} {tool}: "
                              f"{cells[tool].timings[-1].seconds:.1f} s", flush=True)  # fmt: skip
                if args.ppl:
                    for tool in cells:
                        if tool != "floor":
                            found = list(case.out(tool).rglob("config.json"))
                            cells[tool].ppl = perplexities(found[0].parent, texts, seqlen)
                lines += report(size, scheme, cells)
                print("\n".join(report(size, scheme, cells)), flush=True)
                results[f"{scheme}@{size}"] = {k: asdict(c) for k, c in cells.items()}
    print("\n" + "\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
