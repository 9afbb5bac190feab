"""Benchmark msquant's GPTQ on one linear layer (a script, not a test).

Builds correlated activations ``X = Z @ M`` (decaying spectrum, a few outlier channels), accumulates
the Hessian with :class:`msquant.quant.hessian.HessianAccumulator` in small batches (timed against
one plain ``X^T X`` of the same rows), then for int8 per-channel sym, int8 group-128 asym and int4
group-128 sym prints: GPTQ solve time, round-to-nearest time, the relative output error
``||X W^T - X Q^T|| / ||X W^T||`` on the calibration rows and on held-out rows for both, and the
solve's GFLOP/s by the count ``out * in^2 + in^3 / 3`` next to a float32 ``in^3`` matmul measured
in the same run. Unless ``--no-baseline``, the textbook algorithm the peers implement (three
factorisations, then the column loop on the ``[out, in]`` weight, float32; :func:`textbook_gptq`) is
run on the same inputs too: its time, its errors and the share of codes on which it agrees.
When ``llmcompressor`` is importable (it pins an older transformers, so install it in a separate
bench environment: ``pip install torch==2.13.0 llmcompressor==0.14.0.1 && pip install -e . --no-deps``),
its ``quantize_weight`` runs on the identical weight and Hessian (its default min/max observer
scales, no act-order) and its time and errors are printed with the ratio to msquant's.

    python bench/gptq_layer.py                 # 4096 x 4096 layer, 16384 + 4096 rows
    python bench/gptq_layer.py --size 1024     # quicker (rows scale with the size)
    python bench/gptq_layer.py --device cuda   # on a GPU (data built on the CPU, then moved)
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import torch

from msquant.plugin.devices import Backend, get_backend
from msquant.plugin.numerics import (
    HessianAccumulator,
    compute_qparams,
    gptq_quantize,
    qrange,
    quantize_weight_minmax,
)

T = TypeVar("T")

CONFIGS: list[tuple[str, int, bool, int | None]] = [
    ("int8 per-channel sym", 8, True, None),
    ("int8 group-128 asym", 8, False, 128),
    ("int4 group-128 sym", 4, True, 128),
]


def best_time(fn: Callable[[], T], repeat: int, backend: Backend | None = None) -> tuple[float, T]:
    """Minimum wall time of ``repeat`` (>= 1) calls and the last call's result (the backend's
    device is synchronised before and after each call, so queued device work is counted)."""
    best = math.inf
    for _ in range(repeat):
        if backend is not None:
            backend.synchronize()
        started = time.perf_counter()
        result = fn()
        if backend is not None:
            backend.synchronize()
        best = min(best, time.perf_counter() - started)
    return best, result


def textbook_gptq(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, symmetric: bool, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The peers' route in float32 (percdamp 0.01, block 128): int8 codes and the fake-quant weight.

    Cholesky, ``cholesky_inverse`` and upper Cholesky of ``H^-1``; per column of the ``[out, in]``
    weight: round, error ``(w - q) / U[j, j]``, update of the rest of the block; lazy block update.
    """
    qmin, qmax = qrange(bits)
    W = weight.clone()
    H = hessian.clone()
    rows, cols = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(0.01 * torch.mean(torch.diag(H)))
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    scale, offset = compute_qparams(weight.amin(1), weight.amax(1), bits, symmetric)
    codes = torch.zeros(rows, cols, dtype=torch.int8, device=W.device)
    fake = torch.zeros(rows, cols, device=W.device)
    for first in range(0, cols, 128):
        last = min(first + 128, cols)
        W1 = W[:, first:last].clone()
        E1 = torch.zeros_like(W1)
        for i in range(last - first):
            col = first + i
            if group_size is not None and col % group_size == 0:
                part = W[:, col : col + group_size]
                scale, offset = compute_qparams(part.amin(1), part.amax(1), bits, symmetric)
            w = W1[:, i]
            c = torch.clamp(torch.round(w / scale + offset), qmin, qmax)
            codes[:, col] = c.to(torch.int8)
            fake[:, col] = (c - offset) * scale
            err = (w - fake[:, col]) / U[col, col]
            W1[:, i:] -= err.unsqueeze(1) @ U[col, first + i : last].unsqueeze(0)
            E1[:, i] = err
        W[:, last:] -= E1 @ U[first:last, last:]
    return codes, fake


def make_activations(rows: int, size: int, mixing: torch.Tensor, seed: int) -> torch.Tensor:
    """Correlated activations: Gaussian rows through a mixing matrix, a few outlier channels."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, size, generator=generator)
    x = z @ mixing
    x[:, : max(1, size // 256)] *= 20.0  # outlier channels
    return x


def llmcompressor_gptq(
    weight: torch.Tensor, hessian: torch.Tensor, bits: int, symmetric: bool, group_size: int | None
) -> torch.Tensor | None:
    """llm-compressor's GPTQ on the same inputs: its fake-quantized weight (None if not installed).

    Scales come from compressed-tensors' ``calculate_qparams`` on the row / group min and max, what
    llm-compressor's default ``minmax`` observer computes before the sweep.
    """
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.utils import calculate_qparams
        from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    except ImportError:
        return None
    strategy = "channel" if group_size is None else "group"
    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size
    )
    out_features, in_features = weight.shape
    width = in_features if group_size is None else group_size
    grouped = weight.reshape(out_features, in_features // width, width)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    quantized, _, _ = quantize_weight(
        weight.unsqueeze(0).clone(),
        hessian.unsqueeze(0).clone(),
        scale.unsqueeze(0),
        zero_point.unsqueeze(0),
        None,
        args,
        blocksize=128,
        percdamp=0.01,
    )
    return quantized[0]


def relative_error(gram: torch.Tensor, diff: torch.Tensor, reference: float) -> float:
    """``||X D^T|| / ||X W^T||`` from the Gram matrix ``X^T X`` (``reference = ||X W^T||^2``)."""
    return math.sqrt(max(float(((diff @ gram) * diff).sum()), 0.0) / reference)


def main() -> None:
    """Parse options, run the benchmark, print one block per configuration."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="in = out features (default 4096)")
    parser.add_argument("--rows", type=int, default=None, help="calibration rows (default 4*size)")
    parser.add_argument("--heldout", type=int, default=None, help="held-out rows (default size)")
    parser.add_argument("--batch", type=int, default=128, help="rows per add_batch call")
    parser.add_argument("--repeat", type=int, default=2, help="timed repeats (minimum is shown)")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the textbook float32 implementation"
    )
    parser.add_argument(
        "--full-range",
        action="store_true",
        help="msquant's symmetric scales max|w| / (2^(b-1) - 0.5) (ext full_range), as the peers",
    )
    parser.add_argument(
        "--static-groups",
        action="store_true",
        help="msquant's group parameters from the original weight (ext static_groups), as "
        "llm-compressor's observer fixes them",
    )
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N] (default cpu)")
    args = parser.parse_args()
    backend = get_backend(args.device)
    timed = partial(best_time, backend=backend)

    size = args.size
    rows = args.rows or 4 * size
    heldout = args.heldout or size
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, device {backend.device}"
    )

    # 1. Data: X = Z M with singular values of M decaying from 1 to e^-5; weight ~ N(0, 0.02).
    generator = torch.Generator().manual_seed(1)
    basis, _ = torch.linalg.qr(torch.randn(size, size, generator=generator))
    spectrum = torch.exp(-5.0 * torch.arange(size, dtype=torch.float32) / size)
    mixing = (basis * spectrum) @ basis.t()
    calib = make_activations(rows, size, mixing, seed=2)
    held = make_activations(heldout, size, mixing, seed=3)
    weight = torch.randn(size, size, generator=generator) * 0.02
    calib, held, weight = (backend.tensor_to_device(t) for t in (calib, held, weight))

    # 2. Throughput reference: float32 size^3 matmul.
    a, b = (backend.tensor_to_device(torch.randn(size, size)) for _ in range(2))
    a @ b
    matmul_s, _ = timed(lambda: a @ b, 3)
    matmul_gflops = 2 * size**3 / matmul_s / 1e9
    print(f"float32 {size}^3 matmul: {matmul_s:.3f} s = {matmul_gflops:.1f} GFLOP/s")

    # 3. Hessian accumulation in batches vs one plain X^T X.
    plain_s, gram = timed(lambda: calib.t() @ calib, args.repeat)

    def accumulate() -> HessianAccumulator:
        acc = HessianAccumulator(size, name="bench")
        for first in range(0, rows, args.batch):
            acc.add_batch(calib[first : first + args.batch])
        acc.flush()
        return acc

    accum_s, acc = timed(accumulate, args.repeat)
    raw, count = acc.raw_sum()
    print(
        f"Hessian: {rows} rows in batches of {args.batch}: {accum_s:.3f} s; plain X^T X: "
        f"{plain_s:.3f} s; ratio {accum_s / plain_s:.2f} "
        f"(max rel diff {float((raw - gram).abs().max() / gram.abs().max()):.1e})"
    )
    held_gram = held.t() @ held
    ref_calib = float(((weight @ gram) * weight).sum())
    ref_held = float(((weight @ held_gram) * weight).sum())
    flop = size * size**2 + size**3 / 3
    hessian = raw * (2.0 / count)  # for the textbook baseline, which takes H itself

    # 4. Each configuration: GPTQ solve and round-to-nearest, times and errors.
    for label, bits, symmetric, group_size in CONFIGS:
        solve = partial(
            gptq_quantize,
            weight,
            raw,
            bits=bits,
            symmetric=symmetric,
            group_size=group_size,
            hessian_scale=2.0 / count,
            nsamples=count,
            name="bench",
            full_range=args.full_range,
            static_groups=args.static_groups,
            backend=backend,
        )
        solve_s, result = timed(solve, args.repeat)
        rtn_s, rtn = timed(
            partial(
                quantize_weight_minmax,
                weight,
                bits,
                symmetric,
                group_size,
                name="bench",
                full_range=args.full_range,
            ),
            args.repeat,
        )
        gptq_diff = weight - result.quantized.dequantize()
        rtn_diff = weight - rtn.dequantize()
        errors = [
            relative_error(gram, gptq_diff, ref_calib),
            relative_error(held_gram, gptq_diff, ref_held),
            relative_error(gram, rtn_diff, ref_calib),
            relative_error(held_gram, rtn_diff, ref_held),
        ]
        gflops = flop / solve_s / 1e9
        baseline = ""
        if not args.no_baseline:
            base_s, base = timed(
                partial(textbook_gptq, weight, hessian, bits, symmetric, group_size), 1
            )
            base_codes, base_fake = base
            same = float((base_codes == result.quantized.codes).float().mean())
            baseline = (
                f"\n  textbook float32 GPTQ {base_s:.3f} s ({base_s / solve_s:.1f}x msquant's time), "
                f"errors calib {relative_error(gram, weight - base_fake, ref_calib):.5f} "
                f"held-out {relative_error(held_gram, weight - base_fake, ref_held):.5f}, "
                f"codes equal to msquant's: {100 * same:.2f}%"
            )
        peer = ""
        peer_s, peer_fake = timed(
            partial(llmcompressor_gptq, weight, hessian, bits, symmetric, group_size), args.repeat
        )
        if peer_fake is not None:
            peer = (
                f"\n  llm-compressor GPTQ {peer_s:.3f} s ({peer_s / solve_s:.2f}x msquant's time), "
                f"errors calib {relative_error(gram, weight - peer_fake, ref_calib):.5f} "
                f"held-out {relative_error(held_gram, weight - peer_fake, ref_held):.5f}"
            )
        if args.full_range and symmetric:
            label += ", full_range"
        if args.static_groups and group_size is not None:
            label += ", static groups"
        print(
            f"\n{label} ({size}x{size}, percdamp 0.01, block 128):\n"
            f"  GPTQ solve {solve_s:.3f} s = {gflops:.1f} GFLOP/s "
            f"({100 * gflops / matmul_gflops:.0f}% of the matmul), RTN {rtn_s:.3f} s\n"
            f"  rel. output error calib:    GPTQ {errors[0]:.5f}   RTN {errors[2]:.5f}   "
            f"({100 * (1 - errors[0] / errors[2]):.0f}% lower)\n"
            f"  rel. output error held-out: GPTQ {errors[1]:.5f}   RTN {errors[3]:.5f}   "
            f"({100 * (1 - errors[1] / errors[3]):.0f}% lower)" + baseline + peer
        )


if __name__ == "__main__":
    main()
