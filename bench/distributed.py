"""dp_layer_wise speed-up: one process against N gloo processes on the CPU (a script, not a test).

Builds a random Llama whose layers are wide enough for the Hessians and GPTQ solves to dominate
(hidden 2048, intermediate 5632, 2 layers by default), quantizes it with GPTQ int4 group-128 once
with one process (all cores to it) and once with ``--nproc N`` (the cores shared out), each via the
``msquant quant`` command, and prints per run: the time of the layer loop (calibration forwards,
Hessians and solves; from ``quant_report.json``), the whole command's time, and the ratios; it
also checks that both exports hold the same tensors, byte for byte.

With ``--per-device`` the one-process run is held to the cores one process of the group gets
(``OMP_NUM_THREADS``), which measures how the run scales with devices (one NPU or GPU per
process) rather than how N processes share one CPU.

    python bench/distributed.py                  # 1 vs 2 processes
    python bench/distributed.py --per-device     # 1 vs 2 "devices" of cores // 2 threads each
    python bench/distributed.py --nproc 4 --hidden 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from random_llama import CALIB_TXT, build_model, gptq_int4_config


def run(
    model: Path, save: Path, config: Path, nproc: int, tokens: int, threads: int | None = None
) -> dict[str, float]:
    """One ``msquant quant`` command; its wall time and the report's layer-loop time.

    :param threads: limit the single process to this many threads (``OMP_NUM_THREADS``); a
        spawned group shares the cores out by itself (cores // processes each).
    """
    command = [
        sys.executable, "-m", "msquant", "quant", "--model_path", str(model),
        "--save_path", str(save), "--config_path", str(config),
        "--calib_path", str(CALIB_TXT),
        "--max_calib_tokens", str(tokens), "--no_progress", "--overwrite", "--no_verify",
        "--nproc", str(nproc), "--log_level", "WARNING",
    ]  # fmt: skip
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env)
    wall = time.perf_counter() - started
    report = json.loads((save / "quant_report.json").read_text())
    layers = sum(layer["seconds"] for layer in report["layers"])
    return {"wall": wall, "layers": layers}


def compare(first: Path, second: Path) -> str:
    """How far two Ascend exports differ: share of differing int8 codes, largest relative
    difference of the other tensors (the Hessians are summed in another order)."""
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}
        for file in sorted(folder.glob("quant_model_weights*.safetensors")):
            found.update(load_file(str(file)))
        return found

    a, b = tensors(first), tensors(second)
    if set(a) != set(b):
        return "different tensor names"
    codes = differing = 0
    worst = 0.0
    for name, tensor in a.items():
        if tensor.dtype == torch.int8:
            codes += tensor.numel()
            differing += int((tensor != b[name]).sum())
        else:
            scale = float(tensor.float().abs().max()) or 1.0
            worst = max(worst, float((tensor.float() - b[name].float()).abs().max()) / scale)
    if differing == 0 and worst == 0.0:
        return "identical"
    return f"{100 * differing / codes:.3f}% of int8 codes differ, float tensors within {worst:.1e}"


def main() -> None:
    """Parse options, build the model, run both configurations, print times and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--tokens", type=int, default=256, help="calibration tokens per sample")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the model here")
    parser.add_argument(
        "--per-device",
        action="store_true",
        help="scaling per device: the one-process run gets the share of the cores one process "
        "of the group has (cores // nproc), as one NPU per process would",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as temp:
        work = args.workdir or Path(temp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_model(
            work / f"llama-{args.layers}L-{args.hidden}", args.layers, args.hidden,
            args.intermediate,
        )  # fmt: skip
        config = work / "gptq.yaml"
        config.write_text(yaml.safe_dump(gptq_int4_config()))
        threads = max(1, (os.cpu_count() or 1) // args.nproc) if args.per_device else None
        one = run(model, work / "out-1", config, 1, args.tokens, threads)
        many = run(model, work / f"out-{args.nproc}", config, args.nproc, args.tokens)
        label = f" ({threads} thread(s), as one device)" if threads else " (all cores)"
        print(
            f"1 process{label}:   layer loop {one['layers']:7.1f} s, command {one['wall']:7.1f} s"
        )
        print(
            f"{args.nproc} processes: layer loop {many['layers']:7.1f} s, "
            f"command {many['wall']:7.1f} s"
        )
        print(
            f"speed-up: layer loop {one['layers'] / many['layers']:.2f}x, "
            f"command {one['wall'] / many['wall']:.2f}x"
        )
        print(f"exports: {compare(work / 'out-1', work / f'out-{args.nproc}')}")


if __name__ == "__main__":
    main()
