"""Packing one quantized linear into GPTQ tensors (pure functions).

Per quantized linear ``P`` (``b`` bits, ``G`` groups): ``P.qweight`` int32 ``[in*b/32, out]``
(unsigned codes packed along the input dimension, least significant bits first), ``P.qzeros``
int32 ``[G, out*b/32]`` (unsigned zero points packed along the output dimension; ``gptq`` stores
``(zero - 1) mod 2^b``, ``gptq_v2`` stores ``zero``), ``P.scales`` float16 ``[G, out]``,
``P.g_idx`` int32 ``[in]`` (always ``i // group_size``) and ``P.bias`` float16.
"""

from __future__ import annotations

import torch

from msquant.plugin import QuantizedLinear
from msquant.plugin.export import pack_int32
from msquant.processors.formats.gptq.scheme import CheckpointFormat, gptq_error

__all__ = [
    "SUPPORTED_BITS",
    "PLANAR_BITS",
    "CT_ALTERNATIVE",
    "check_bits",
    "fp16_scales",
    "stored_zero_points",
    "check_v1_zero_points",
    "gptq_module_tensors",
]

SUPPORTED_BITS = (2, 3, 4, 8)
#: Bit widths GPTQModel stores only in its planar ``gptq_p`` format.
PLANAR_BITS = (5, 6, 7)
CT_ALTERNATIVE = (
    "use `type: compressed_tensors` instead (pack-quantized, which vLLM serves asymmetric and "
    "2-8 bit)"
)


def check_bits(name: str, bits: int) -> None:
    """Refuse bit widths the (non-planar) GPTQ layout cannot hold.

    :raises QuantizationError: naming the module and the alternative.
    """
    if bits in SUPPORTED_BITS:
        return
    if bits in PLANAR_BITS:
        raise gptq_error(
            name,
            f"int{bits} weights need GPTQModel's planar gptq_p format, which this saver does not "
            f"write (GPTQ stores 2, 3, 4 or 8 bits); {CT_ALTERNATIVE}",
        )
    raise gptq_error(name, f"int{bits} weights cannot be stored as GPTQ (2, 3, 4 or 8 bits)")


def fp16_scales(name: str, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (float32 ``[out, G]``) as GPTQ's float16 ``scales [G, out]``.

    :raises QuantizationError: when a scale overflows float16 or a nonzero one flushes to 0.
    """
    half = scale.to(torch.float16)
    overflow = ~torch.isfinite(half)
    underflow = (half == 0) & (scale != 0)
    if bool(overflow.any()) or bool(underflow.any()):
        bad = scale[overflow | underflow]
        raise gptq_error(
            name,
            f"{bad.numel()} scale(s) are not representable in float16 (e.g. {float(bad[0]):.3g}; "
            "float16 holds about 6e-8 to 65504), which GPTQ requires; this weight cannot be "
            "exported as GPTQ",
        )
    return half.t().contiguous()


def stored_zero_points(
    zeros: torch.Tensor, bits: int, checkpoint_format: CheckpointFormat
) -> torch.Tensor:
    """The zero-point fields GPTQ stores: ``(zero - 1) mod 2^b`` for v1 ``gptq``, ``zero`` for
    ``gptq_v2``."""
    if checkpoint_format == "gptq":
        return torch.remainder(zeros - 1, 2**bits)
    return zeros


def check_v1_zero_points(name: str, zeros: torch.Tensor, symmetric: bool) -> None:
    """v1 ``gptq`` cannot hold an asymmetric zero point of 0 (``0 - 1`` wraps and carries)."""
    count = int((zeros == 0).sum()) if not symmetric else 0
    if count:
        raise gptq_error(
            name,
            f"{count} zero point(s) are 0, which the v1 `gptq` format cannot store (zero - 1 "
            "wraps to 2^bits - 1 and the loaders' word-wise +1 carries into the next column); "
            "set `checkpoint_format: gptq_v2` (or `auto`)",
        )


def _check_packable(name: str, bits: int, out_features: int, in_features: int) -> None:
    """GPTQ packs whole int32 words: ``in * b`` and ``out * b`` must be multiples of 32."""
    for what, width in (("in_features", in_features), ("out_features", out_features)):
        if width * bits % 32:
            raise gptq_error(
                name,
                f"{what} {width} times {bits} bits is not a multiple of 32, so the layer cannot "
                "be packed into GPTQ's int32 words",
            )


def gptq_module_tensors(
    name: str, module: QuantizedLinear, checkpoint_format: CheckpointFormat
) -> dict[str, torch.Tensor]:
    """The GPTQ tensors of one quantized linear layer ``name`` (CPU tensors, keyed by full name).

    Reads the layer's :class:`msquant.plugin.QuantizedWeight` without modifying it.

    :raises QuantizationError: for a bit width GPTQ cannot store, a shape that does not pack into
        whole words, scales not representable in float16, or a bias overflowing float16.
    """
    weight = module.qweight
    check_bits(name, weight.bits)
    out_features, in_features = weight.shape
    _check_packable(name, weight.bits, out_features, in_features)
    codes = weight.unsigned_codes().cpu()
    try:
        zeros = weight.unsigned_zero_points().cpu()
    except ValueError as error:
        raise gptq_error(name, str(error)) from error
    if checkpoint_format == "gptq":
        check_v1_zero_points(name, zeros, weight.symmetric)
    tensors = {
        f"{name}.qweight": pack_int32(codes.t(), weight.bits, dim=0),
        f"{name}.qzeros": pack_int32(
            stored_zero_points(zeros.t(), weight.bits, checkpoint_format), weight.bits, dim=1
        ),
        f"{name}.scales": fp16_scales(name, weight.scale.cpu()),
        f"{name}.g_idx": weight.g_idx(),
    }
    if module.bias is not None:
        bias = module.bias.detach().cpu().to(torch.float16)
        if not bool(torch.isfinite(bias).all()):
            raise gptq_error(name, "the bias overflows float16, which GPTQ stores it in")
        tensors[f"{name}.bias"] = bias
    return tensors
