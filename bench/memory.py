"""Peak memory of a quantization run against model depth (a script, not a test).

Builds random Llama models from one config (hidden 1024, intermediate 2816) with 4, 8 and 16
decoder layers, quantizes each (GPTQ int4 group-128, Ascend export with read-back verification)
in a fresh process with the streamed runner (``layer_wise``, the default) and with the whole-model
runner (``model_wise``), and prints each run's peak resident memory (``ru_maxrss``) and the ratio
of the 16-layer run to the 4-layer run. The streamed runner's ratio should stay near 1: only one
decoder layer is in memory at a time.

Beside each peak it prints the run's ``--max_memory`` estimate (:mod:`msquant.run.memory_estimate`,
computed in this process, before the run) and what the run's data took: its peak minus the peak of
the same run on a one-layer model 128 wide (the interpreter and every library the run loads, which
the estimate leaves out, at a few MiB of data). ``--config`` replaces the GPTQ config by a YAML
file (e.g. a practice).

    python bench/memory.py                      # 4, 8, 16 layers
    python bench/memory.py --layers 4 16 --hidden 512
    python bench/memory.py --layers 4 --config msquant/data/practices/w8a8.yaml
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import yaml
from random_llama import CALIB_TXT, build_model, gptq_int4_config

from msquant.run.plan_memory import plan_with_memory

# Runs in a child process so that each measurement starts from a fresh interpreter.
CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch
    import msquant
    model, save, config, calib, tokens = sys.argv[1:6]
    torch.manual_seed(0)
    started = time.perf_counter()
    msquant.quantize(model, save, json.loads(config), calib_path=calib,
                     max_calib_tokens=int(tokens), progress=False, overwrite=True)
    seconds = time.perf_counter() - started
    print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "seconds": seconds}))
    """
)


def run_config(runner: str, path: Path | None) -> dict[str, Any]:
    """The GPTQ int4 config, or the YAML at ``path``, with ``spec.runner`` set."""
    if path is None:
        return gptq_int4_config(runner)
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    config["spec"]["runner"] = runner
    return dict(config)


def estimate_mib(model: Path, config: dict[str, Any], tokens: int) -> float:
    """The run's ``--max_memory`` estimate, in MiB (one process)."""
    _, estimate = plan_with_memory(model, config, calib_path=CALIB_TXT, max_calib_tokens=tokens)
    assert estimate is not None, "the config does not apply to the model"
    return estimate.total / 2**20


def measure(
    model: Path, runner: str, work: Path, tokens: int, config: dict[str, Any]
) -> dict[str, float]:
    """Peak RSS (MiB) and seconds of one run in a fresh process."""
    save = work / f"out-{model.name}-{runner}"
    calib = CALIB_TXT
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(model),
            str(save),
            json.dumps(config),
            str(calib),
            str(tokens),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def main() -> None:
    """Parse options, build the models, print one line per run and the depth ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--tokens", type=int, default=128, help="calibration tokens per sample")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="keep models here (default: temp)"
    )
    parser.add_argument("--config", type=Path, default=None, help="a YAML config instead of GPTQ")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as temp:
        work = args.workdir or Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        peaks: dict[str, dict[int, float]] = {"layer_wise": {}, "model_wise": {}}
        tiny = build_model(work / "llama-1L-128", 1, 128, 256)  # group 128 divides its widths
        baselines = {
            runner: measure(tiny, runner, work, args.tokens, run_config(runner, args.config))
            for runner in peaks
        }
        for runner, result in baselines.items():
            print(f"one layer 128 wide, {runner:10s}: peak RSS {result['peak_mib']:8.1f} MiB")
        for layers in args.layers:
            model = build_model(
                work / f"llama-{layers}L-{args.hidden}", layers, args.hidden, args.intermediate
            )
            weights = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 2**20
            for runner in peaks:
                config = run_config(runner, args.config)
                result = measure(model, runner, work, args.tokens, config)
                peaks[runner][layers] = result["peak_mib"]
                added = result["peak_mib"] - baselines[runner]["peak_mib"]
                print(
                    f"{layers:3d} layers ({weights:7.1f} MiB of weights), {runner:10s}: "
                    f"peak RSS {result['peak_mib']:8.1f} MiB, {result['seconds']:6.1f} s; "
                    f"above the one-layer run {added:7.1f} MiB, "
                    f"estimated {estimate_mib(model, config, args.tokens):7.1f} MiB",
                    flush=True,
                )
        low, high = min(args.layers), max(args.layers)
        for runner, by_layers in peaks.items():
            print(
                f"{runner}: peak RSS {high} layers / {low} layers = "
                f"{by_layers[high] / by_layers[low]:.2f}"
            )


if __name__ == "__main__":
    main()
