"""Peak extra host memory of one GPTQ solve, in copies of the weight and of the Hessian.

Each configuration runs in a fresh subprocess that loads a ``size x size`` float32 weight and
Hessian from files (so setting up allocates nothing beyond the two tensors), reads its resident
set size, solves, and reports the peak resident set size (``ru_maxrss``) minus that baseline.
The issue's target: at most 3 weight copies plus 2 Hessian copies (5 x 64 MiB at size 4096).

    python bench/gptq_memory.py [--size 4096]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CONFIGS = [
    ("int8 per-channel sym", 8, True, None, False),
    ("int8 group-128 asym", 8, False, 128, False),
    ("int4 group-128 sym", 4, True, 128, False),
    ("int4 group-128 sym, act-order", 4, True, 128, True),
]


def current_rss_bytes() -> int:
    """Resident set size now (Linux ``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def child(folder: Path, index: int) -> None:
    """Solve one configuration and print the measurement as JSON."""
    from msquant.plugin.numerics import gptq_quantize

    name, bits, symmetric, group, desc_act = CONFIGS[index]
    weight = torch.load(folder / "weight.pt", weights_only=True)
    hessian = torch.load(folder / "hessian.pt", weights_only=True)
    baseline = current_rss_bytes()
    gptq_quantize(
        weight, hessian, bits=bits, symmetric=symmetric, group_size=group, desc_act=desc_act
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"name": name, "extra": peak - baseline, "bytes": weight.numel() * 4}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.folder, args.child)
        return
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = (
            torch.randn(2 * args.size, args.size)
            @ torch.randn(args.size, args.size)
            / args.size**0.5
        )
        torch.save(torch.randn(args.size, args.size) * 0.02, folder / "weight.pt")
        torch.save(2 * rows.T @ rows / rows.shape[0], folder / "hessian.pt")
        del rows
        print(
            f"weight and Hessian {args.size}x{args.size} float32: {args.size**2 * 4 / 2**20:.0f} MiB each"
        )
        for index in range(len(CONFIGS)):
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(index), "--folder", str(folder)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(out.stdout.strip().splitlines()[-1])
            copies = result["extra"] / result["bytes"]
            print(
                f"{result['name']:32s} peak extra {result['extra'] / 2**20:7.1f} MiB "
                f"= {copies:.2f} copies of a {args.size}x{args.size} float32 matrix (target <= 5)"
            )


if __name__ == "__main__":
    main()
