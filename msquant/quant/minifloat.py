"""Small floating-point element formats (OCP FP8 e4m3 and FP4 e2m1): their codes and values.

Pure functions over bit patterns, the storage side of the MX value types
(:mod:`msquant.quant.mx_quant`). A code is ``sign | exponent | mantissa`` (sign in the top bit):

* **e4m3** (OCP FP8 ``E4M3FN``, torch's ``float8_e4m3fn``): 4 exponent bits (bias 7), 3 mantissa
  bits, no infinities, NaN at ``0x7F`` / ``0xFF``; largest finite value 448, smallest subnormal
  ``2^-9``;
* **e2m1** (OCP FP4): 2 exponent bits (bias 1), 1 mantissa bit, no infinities or NaN; the values
  0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.

An exponent field of 0 is subnormal (``mantissa * 2^(1 - bias - mantissa_bits)``), any other is
``(1 + mantissa / 2^mantissa_bits) * 2^(exponent - bias)``. The non-negative codes ``0 .. max``
are increasing in value, which :meth:`ElementFormat.encode` relies on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

__all__ = ["E2M1", "E4M3", "ElementFormat", "pack_nibbles", "unpack_nibbles"]


@dataclass(frozen=True)
class ElementFormat:
    """One sign-exponent-mantissa element format (see the module docstring).

    :param name: ``e4m3`` or ``e2m1``.
    :param exponent_bits: width of the exponent field.
    :param mantissa_bits: width of the explicit mantissa field.
    :param bias: exponent bias.
    :param nan_codes: codes that mean NaN (none for e2m1).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    nan_codes: tuple[int, ...] = ()

    @property
    def bits(self) -> int:
        """Width of a code: sign, exponent and mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def sign_bit(self) -> int:
        """The code bit holding the sign."""
        return 1 << (self.bits - 1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The float64 values of integer ``codes`` (any shape; NaN codes give NaN)."""
        codes = codes.to(torch.int64) & ((1 << self.bits) - 1)
        mantissa = (codes & ((1 << self.mantissa_bits) - 1)).double()
        exponent = (codes >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        step = 2.0**-self.mantissa_bits
        normal = (1.0 + mantissa * step) * torch.pow(2.0, (exponent - self.bias).double())
        subnormal = mantissa * step * 2.0 ** (1 - self.bias)
        magnitude = torch.where(exponent == 0, subnormal, normal)
        value = torch.where((codes & self.sign_bit) != 0, -magnitude, magnitude)
        for nan in self.nan_codes:
            value = torch.where(codes == nan, torch.full_like(value, float("nan")), value)
        return value

    @cached_property
    def magnitudes(self) -> torch.Tensor:
        """The finite non-negative values in code order (code ``i`` has ``magnitudes[i]``)."""
        codes = torch.arange(self.sign_bit)
        finite = [c for c in range(self.sign_bit) if c not in self.nan_codes]
        return self.decode(codes[finite])

    @property
    def max_value(self) -> float:
        """The largest finite value (448 for e4m3, 6 for e2m1)."""
        return float(self.magnitudes[-1])

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The uint8 codes of ``values``, each exactly representable (``-0.0`` has the sign bit).

        :raises ValueError: when a value is not a finite value of this format.
        """
        values = values.double()
        magnitude = values.abs()
        table = self.magnitudes
        index = torch.bucketize(magnitude, table).clamp(max=len(table) - 1)
        exact = table[index] == magnitude
        if not bool(exact.all()):
            bad = values[~exact].flatten()[:3].tolist()
            raise ValueError(f"values {bad} are not {self.name} values")
        sign = torch.signbit(values).to(torch.int64) * self.sign_bit
        return (index + sign).to(torch.uint8)


#: OCP FP8 E4M3 (``float8_e4m3fn``): MXFP8's element.
E4M3 = ElementFormat("e4m3", exponent_bits=4, mantissa_bits=3, bias=7, nan_codes=(0x7F, 0xFF))
#: OCP FP4 E2M1: MXFP4's element.
E2M1 = ElementFormat("e2m1", exponent_bits=2, mantissa_bits=1, bias=1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., n]`` (n even) as uint8 ``[..., n / 2]``: element ``2i`` in the low
    nibble, ``2i + 1`` in the high one (msModelSlim's FP4 packing)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"two 4-bit codes per byte need an even last dimension, got {codes.shape}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., n / 2]`` to codes uint8 ``[..., n]``."""
    packed = packed.to(torch.uint8)
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], -1)
