"""Packing one quantized linear into AWQ GEMM tensors (pure functions).

Per quantized linear ``P`` (4 bits, ``G`` groups of ``group_size`` input columns):

* ``P.qweight`` int32 ``[in, out/8]``: the unsigned codes ``q + 8`` of input column ``i`` packed
  along the *output* dimension, eight per word, in AWQ's interleaved order: nibble ``k`` (bits
  ``4k..4k+3``) of word ``j`` holds output ``8j + AWQ_ORDER[k]``;
* ``P.qzeros`` int32 ``[G, out/8]``: the unsigned zero points, packed the same way;
* ``P.scales`` float16 ``[G, out]``; ``P.bias`` float16.

Dequantization: ``W[o, i] = scales[g, o] * (q[i, o] - zeros[g, o])`` with ``g = i // group_size``.
Symmetric weights are stored with the zero point 8 (``zero_point: true`` covers both).
"""

from __future__ import annotations

import torch

from msquant.plugin import QuantizationError, QuantizedLinear
from msquant.plugin.export import pack_int32

__all__ = ["AWQ_BITS", "AWQ_ORDER", "PACK", "awq_module_tensors", "interleave"]

AWQ_BITS = 4
#: Which output (within a block of eight) nibble ``k`` of a word holds.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 32 // AWQ_BITS


def _fail(name: str, message: str) -> QuantizationError:
    return QuantizationError(f"autoawq_saver: {name}: {message}")


def interleave(values: torch.Tensor) -> torch.Tensor:
    """``values [rows, out]`` with each block of eight outputs put in AWQ's nibble order."""
    rows, out = values.shape
    order = torch.tensor(AWQ_ORDER)
    return values.reshape(rows, out // PACK, PACK)[:, :, order].reshape(rows, out)


def awq_module_tensors(name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
    """The AWQ tensors of the quantized linear ``name`` (CPU tensors, keyed by full name).

    :raises QuantizationError: for a width other than 4 bits, a per-channel weight, an output
        width that is not a multiple of 8, or scales or a bias that float16 cannot hold.
    """
    weight = module.qweight
    if weight.bits != AWQ_BITS or weight.group_size is None:
        scope = "per-channel" if weight.group_size is None else f"group {weight.group_size}"
        raise _fail(
            name,
            f"AWQ stores 4-bit per-group weights only, this one is int{weight.bits} {scope}; "
            "use type: gptq_saver or compressed_tensors",
        )
    out_features = weight.shape[0]
    if out_features % PACK:
        raise _fail(name, f"out_features {out_features} is not a multiple of {PACK} (AWQ packing)")
    codes = weight.unsigned_codes().cpu()
    try:
        zeros = weight.unsigned_zero_points().cpu()
    except ValueError as error:
        raise _fail(name, str(error)) from error
    scales = weight.scale.cpu().to(torch.float16)
    lost = ~torch.isfinite(scales) | ((scales == 0) & (weight.scale.cpu() != 0))
    if bool(lost.any()):
        raise _fail(name, f"{int(lost.sum())} scale(s) are not representable in float16")
    tensors = {
        f"{name}.qweight": pack_int32(interleave(codes.t().contiguous()), AWQ_BITS, dim=1),
        f"{name}.qzeros": pack_int32(interleave(zeros.t().contiguous()), AWQ_BITS, dim=1),
        f"{name}.scales": scales.t().contiguous(),
    }
    if module.bias is not None:
        bias = module.bias.detach().cpu().to(torch.float16)
        if not bool(torch.isfinite(bias).all()):
            raise _fail(name, "the bias overflows float16, which AWQ stores it in")
        tensors[f"{name}.bias"] = bias
    return tensors
