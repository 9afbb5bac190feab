"""MX (OCP microscaling) block quantization with msModelSlim's numerics (pure functions).

A tensor is cut into blocks of :data:`BLOCK_SIZE` consecutive values along its last dimension (the
input features of a weight ``[out, in]`` or of an activation ``[..., in]``; msModelSlim's
``ext.axes: -1``); the last block is zero-padded when the length is not a multiple of 32. Each
block shares a power-of-two scale ``2^e`` (stored as the E8M0 byte ``e + 127``) and each value is
an element of a small float format (:mod:`msquant.quant.minifloat`): the stored value is
``element * 2^e``. msModelSlim 26.1.0 (``ir/api/impl/mx_quantization.py``, adapted from
Microsoft's ``microxcaling``) computes, with ``amax`` the largest magnitude of a block:

* **MXFP8** (e4m3 elements): ``e = floor(log2(amax)) - 8`` (``amax = 0`` counts as ``2^-126``),
  ``e > 127`` becomes NaN, ``e < -127`` becomes -127. Each scaled value ``v = x / 2^e`` (0 stays
  0) gets its private exponent ``p = max(floor(log2|v|), -6)`` and is rounded to 3 mantissa bits
  *half away from zero* (``sign(v) * floor(|v| / 2^p * 8 + 0.5) / 8 * 2^p``; OCP and torch's
  ``float8_e4m3fn`` cast round half to even), then clamped to ``[-448, 448]`` (saturating: the
  block maximum lies in ``[256, 512)`` after scaling, so values above 448 saturate; infinities
  are kept, NaN propagates).
* **MXFP4** (e2m1 elements): ``e = floor(log2(amax / 0.875 + 9.6e-7)) - 2`` clipped to
  ``[-129, 125]``; ``v = |x| / 2^e``, ``p = clip(floor(log2(v + 9.6e-7)), 0, 2)``, the element
  ``floor(v / 2^p * 2 + 0.5) / 2 * 2^p`` (half away from zero) clipped to 6, with the sign of
  ``x`` (so a negative value rounding to 0 is ``-0.0``, code ``0x8``), 0 for blocks with
  ``e < -127`` (never reached: the ``9.6e-7`` keeps ``e >= -22``).

The exponents are computed in the input's dtype (msModelSlim's observer keeps it: the ``log2`` of
a bf16 block maximum is rounded to bf16 before the floor), the elements in float32. The
``log2`` / ``floor`` formulas are msModelSlim's, not exact exponent extraction: a float32
``amax`` just below a power of two can take the next exponent (``log2`` rounds up), and so do
these functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from msquant.quant.minifloat import E2M1, E4M3, ElementFormat

__all__ = [
    "BLOCK_SIZE",
    "E8M0_BIAS",
    "block_amax",
    "mx_dequantize",
    "mx_elements",
    "mx_exponents",
    "mx_fake_quantize",
    "mx_quantize",
]

#: Values sharing one scale (OCP MX, msModelSlim's ``mx_finfo.block_size``).
BLOCK_SIZE = 32
#: The E8M0 scale byte is the exponent plus this bias (msModelSlim writes ``weight_scale + 127``).
E8M0_BIAS = 127
_FP32_MIN_NORMAL = 2.0**-126
_EPS = 9.6e-7  # msModelSlim's MXFP4 guard against log2(0)


def _blocks(tensor: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """``[..., n]`` zero-padded to a multiple of ``block_size`` and viewed ``[..., blocks, size]``."""
    pad = -tensor.shape[-1] % block_size
    if pad:
        tensor = F.pad(tensor, (0, pad))
    return tensor.reshape(*tensor.shape[:-1], -1, block_size)


def block_amax(tensor: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Largest magnitude of every block, ``[..., ceil(n / block_size)]``, in the input's dtype."""
    return _blocks(tensor, block_size).abs().amax(dim=-1)


def mx_exponents(amax: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """The shared exponents of blocks with largest magnitudes ``amax`` (module docstring), as
    float32 integers (NaN for an MXFP8 exponent above 127)."""
    if element == E4M3:
        floor = amax + _FP32_MIN_NORMAL * (amax == 0).to(amax.dtype)
        exponent = torch.floor(torch.log2(floor)) - 8
        exponent[exponent > E8M0_BIAS] = float("nan")
        exponent[exponent < -E8M0_BIAS] = -E8M0_BIAS
        return exponent.float()
    if element == E2M1:
        exponent = torch.floor(torch.log2(amax / (1 - 0.5**3) + _EPS)) - 2
        return torch.clip(exponent, -E8M0_BIAS - 2, E8M0_BIAS - 2).float()
    raise ValueError(f"no MX rule for element format {element.name}")


def mx_elements(
    blocks: torch.Tensor, exponents: torch.Tensor, element: ElementFormat
) -> torch.Tensor:
    """The element values (float32) of ``blocks`` ``[..., blocks, size]`` under the per-block
    ``exponents`` ``[..., blocks]`` (module docstring): ``value / 2^exponent`` rounded to the
    element format."""
    x = blocks.float()
    shared = exponents.unsqueeze(-1)
    if element == E4M3:
        scaled = torch.where(x == 0, torch.zeros_like(x), x / (2**shared))
        private = torch.floor(torch.log2(torch.abs(scaled) + (scaled == 0).to(scaled.dtype)))
        private = private.clip(min=-6)
        rounded = scaled / (2**private) * 8
        rounded = torch.sign(rounded) * torch.floor(torch.abs(rounded) + 0.5)
        rounded = rounded / 8 * (2**private)
        out = torch.clamp(rounded, min=-448.0, max=448.0)
        out[scaled == float("inf")] = float("inf")
        out[scaled == -float("inf")] = -float("inf")
        return out
    if element == E2M1:
        sign = torch.sign(x)
        biased = torch.abs(x) / torch.exp2(shared)
        private = torch.clip(torch.floor(torch.log2(biased + _EPS)), 0, 2)
        mantissa = torch.floor(biased / (2**private) * 2 + 0.5)
        value = torch.clip(mantissa / 2 * (2**private), -6.0, 6.0)
        value[torch.broadcast_to(shared < -E8M0_BIAS, value.shape)] = 0
        return sign * value
    raise ValueError(f"no MX rule for element format {element.name}")


def mx_quantize(
    tensor: torch.Tensor, element: ElementFormat, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``tensor`` ``[..., n]`` along its last dimension.

    :returns: ``(elements, exponents)``: the float32 element values ``[..., n]`` (padding
        dropped) and the float32 shared exponents ``[..., ceil(n / block_size)]``.
    """
    blocks = _blocks(tensor, block_size)
    exponents = mx_exponents(blocks.abs().amax(dim=-1), element)
    elements = mx_elements(blocks, exponents, element)
    n = tensor.shape[-1]
    return elements.reshape(*tensor.shape[:-1], -1)[..., :n], exponents


def mx_dequantize(
    elements: torch.Tensor, exponents: torch.Tensor, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """``element * 2^exponent`` (float32, ``elements``' shape), each exponent spanning its block."""
    n = elements.shape[-1]
    blocks = _blocks(elements.float(), block_size)
    values = blocks * (2 ** exponents.float().unsqueeze(-1))
    return values.reshape(*elements.shape[:-1], -1)[..., :n]


def mx_fake_quantize(
    x: torch.Tensor, element: ElementFormat, block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """``x`` MX-quantized along its last dimension and dequantized, in ``x``'s dtype (msModelSlim's
    dynamic per-block activations: the exponents come from ``x`` itself, in its dtype)."""
    blocks = _blocks(x, block_size)
    exponents = mx_exponents(blocks.abs().amax(dim=-1), element)
    elements = mx_elements(blocks, exponents, element).to(x.dtype)
    values = elements * (2 ** exponents.to(x.dtype).unsqueeze(-1))
    n = x.shape[-1]
    return values.reshape(*x.shape[:-1], -1)[..., :n].to(x.dtype)
