"""MX (OCP microscaling) block quantization with msModelSlim's numerics (pure functions).

A tensor is cut into blocks of :data:`BLOCK_SIZE` consecutive values along its last dimension (the
input features of a weight ``[out, in]`` or of an activation ``[..., in]``; msModelSlim's
``ext.axes: -1``); the last block is zero-padded when the length is not a multiple of 32. Each
block shares a power-of-two scale ``2^e`` (stored as the E8M0 byte ``e + 127``) and each value is
an element of a small float format (:mod:`msquant.quant.minifloat`): the stored value is
``element * 2^e``. msModelSlim 26.1.0 (``ir/api/impl/mx_quantization.py``, adapted from
Microsoft's ``microxcaling``) has two rules, dispatched on the dtype and written for any element
format (the numbers below are those of e4m3 and e2m1); with ``amax`` the largest magnitude of a
block:

* **rule mxfp8** (MXFP8, e4m3 elements): ``e = floor(log2(amax)) - 8`` (``amax = 0`` counts as ``2^-126``),
  ``e > 127`` becomes NaN, ``e < -127`` becomes -127. Each scaled value ``v = x / 2^e`` (0 stays
  0) gets its private exponent ``p = max(floor(log2|v|), -6)`` and is rounded to 3 mantissa bits
  *half away from zero* (``sign(v) * floor(|v| / 2^p * 8 + 0.5) / 8 * 2^p``; OCP and torch's
  ``float8_e4m3fn`` cast round half to even), then clamped to ``[-448, 448]`` (saturating: the
  block maximum lies in ``[256, 512)`` after scaling, so values above 448 saturate; infinities
  are kept, NaN propagates).
* **rule mxfp4** (MXFP4, e2m1 elements): ``e = floor(log2(amax / 0.875 + 9.6e-7)) - 2`` clipped to
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

import math

import torch
import torch.nn.functional as F

from msquant.quant.minifloat import ElementFormat

__all__ = [
    "BLOCK_SIZE",
    "MX_RULES",
    "E8M0_BIAS",
    "block_amax",
    "e8m0_bytes",
    "e8m0_scale",
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


#: msModelSlim's two MX rules, named by the dtype it dispatches each on (``ir/api/impl/
#: mx_quantization.py``); both are written for any element format (its largest exponent ``emax``,
#: its bias, mantissa bits and largest value), so a new element format reuses one of them.
MX_RULES = ("mxfp8", "mxfp4")


def _emax(element: ElementFormat) -> int:
    """The element's largest exponent, ``floor(log2(max_value))`` (8 for e4m3, 2 for e2m1)."""
    return math.frexp(element.max_value)[1] - 1


def _check_rule(rule: str) -> None:
    if rule not in MX_RULES:
        raise ValueError(f"unknown MX rule {rule!r}; known: {', '.join(MX_RULES)}")


def mx_exponents(amax: torch.Tensor, element: ElementFormat, rule: str = "mxfp8") -> torch.Tensor:
    """The shared exponents of blocks with largest magnitudes ``amax`` under ``rule`` (module
    docstring; ``- 8`` / ``- 2`` there is ``- emax`` of the element), as float32 integers (NaN for
    an ``mxfp8``-rule exponent above 127)."""
    _check_rule(rule)
    emax = _emax(element)
    if rule == "mxfp8":
        floor = amax + _FP32_MIN_NORMAL * (amax == 0).to(amax.dtype)
        exponent = torch.floor(torch.log2(floor)) - emax
        exponent[exponent > E8M0_BIAS] = float("nan")
        exponent[exponent < -E8M0_BIAS] = -E8M0_BIAS
        return exponent.float()
    guard = 1 - 0.5 ** (element.mantissa_bits + 2)
    exponent = torch.floor(torch.log2(amax / guard + _EPS)) - emax
    return torch.clip(exponent, -E8M0_BIAS - emax, E8M0_BIAS - emax).float()


def mx_elements(
    blocks: torch.Tensor, exponents: torch.Tensor, element: ElementFormat, rule: str = "mxfp8"
) -> torch.Tensor:
    """The element values (float32) of ``blocks`` ``[..., blocks, size]`` under the per-block
    ``exponents`` ``[..., blocks]`` and ``rule`` (module docstring): ``value / 2^exponent``
    rounded to the element format (``-6``, ``8``, ``448`` there are ``1 - bias``,
    ``2^mantissa_bits`` and the largest value of the element)."""
    _check_rule(rule)
    x = blocks.float()
    shared = exponents.unsqueeze(-1)
    steps = 2**element.mantissa_bits
    top = element.max_value
    if rule == "mxfp8":
        scaled = torch.where(x == 0, torch.zeros_like(x), x / (2**shared))
        private = torch.floor(torch.log2(torch.abs(scaled) + (scaled == 0).to(scaled.dtype)))
        private = private.clip(min=1 - element.bias)
        rounded = scaled / (2**private) * steps
        rounded = torch.sign(rounded) * torch.floor(torch.abs(rounded) + 0.5)
        rounded = rounded / steps * (2**private)
        out = torch.clamp(rounded, min=-top, max=top)
        out[scaled == float("inf")] = float("inf")
        out[scaled == -float("inf")] = -float("inf")
        return out
    sign = torch.sign(x)
    biased = torch.abs(x) / torch.exp2(shared)
    private = torch.clip(torch.floor(torch.log2(biased + _EPS)), 1 - element.bias, _emax(element))
    mantissa = torch.floor(biased / (2**private) * steps + 0.5)
    value = torch.clip(mantissa / steps * (2**private), -top, top)
    value[torch.broadcast_to(shared < -E8M0_BIAS, value.shape)] = 0
    return sign * value


def mx_quantize(
    tensor: torch.Tensor, element: ElementFormat, rule: str = "mxfp8", block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize ``tensor`` ``[..., n]`` along its last dimension under ``rule``.

    :returns: ``(elements, exponents)``: the float32 element values ``[..., n]`` (padding
        dropped) and the float32 shared exponents ``[..., ceil(n / block_size)]``.
    """
    blocks = _blocks(tensor, block_size)
    exponents = mx_exponents(blocks.abs().amax(dim=-1), element, rule)
    elements = mx_elements(blocks, exponents, element, rule)
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
    x: torch.Tensor, element: ElementFormat, rule: str = "mxfp8", block_size: int = BLOCK_SIZE
) -> torch.Tensor:
    """``x`` MX-quantized along its last dimension and dequantized, in ``x``'s dtype (msModelSlim's
    dynamic per-block activations: the exponents come from ``x`` itself, in its dtype)."""
    blocks = _blocks(x, block_size)
    exponents = mx_exponents(blocks.abs().amax(dim=-1), element, rule)
    elements = mx_elements(blocks, exponents, element, rule).to(x.dtype)
    values = elements * (2 ** exponents.to(x.dtype).unsqueeze(-1))
    n = x.shape[-1]
    return values.reshape(*x.shape[:-1], -1)[..., :n].to(x.dtype)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The E8M0 bytes (uint8 ``e + 127``) of power-of-two scales ``2^e``, ``-127 <= e <= 127``.

    :raises ValueError: for a scale that is not such a power of two.
    """
    mantissa, exponent = torch.frexp(scale.to(torch.float32))
    shared = exponent - 1
    if not bool(((mantissa == 0.5) & (shared >= -E8M0_BIAS) & (shared <= E8M0_BIAS)).all()):
        raise ValueError("MX scales must be powers of two 2^e with -127 <= e <= 127")
    return (shared + E8M0_BIAS).to(torch.uint8)


def e8m0_scale(stored: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``2^(byte - 127)`` of E8M0 bytes (255, E8M0's NaN, gives NaN)."""
    scale = torch.pow(2.0, stored.to(torch.float32) - E8M0_BIAS)
    return torch.where(stored == 255, torch.full_like(scale, float("nan")), scale)
