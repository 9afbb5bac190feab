"""Bit packing of integer codes for the export formats (pure functions).

* :func:`pack_int32` packs unsigned ``bits``-wide values densely into int32 words along one
  dimension, least significant bits first: value ``i`` occupies bits ``[i*b, (i+1)*b)`` of the
  packed bit stream, so for 3, 5, 6 and 7 bits a value may straddle two words. This is the layout of
  GPTQ ``qweight``/``qzeros`` (2, 3, 4, 8 bits) and of compressed-tensors ``pack-quantized``
  (1-8 bits, dense since compressed-tensors 0.20).
* :func:`pack_int4_pairs` stores two signed int4 codes per int8 byte along the last dimension,
  element ``2i`` in the low nibble and ``2i + 1`` in the high nibble (msModelSlim's int4 packing).
"""

from __future__ import annotations

import math

import torch

__all__ = ["pack_int32", "packed_length", "pack_int4_pairs"]

WORD_BITS = 32


def packed_length(count: int, bits: int) -> int:
    """Number of int32 words holding ``count`` values of ``bits`` bits."""
    return -(-count * bits // WORD_BITS)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned integer ``values`` (each in ``[0, 2^bits - 1]``) into int32 words along ``dim``.

    :param values: integer tensor of any shape.
    :param bits: value width, 1 to 8 (16 and 32 also work: they never straddle).
    :param dim: dimension to pack; its length ``n`` becomes ``ceil(n * bits / 32)``.
    :returns: int32 tensor (words holding bit 31 set are negative, as two's complement).
    :raises ValueError: for a non-integer tensor or a value out of range.
    """
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ValueError(f"values must be an integer tensor, got {values.dtype}")
    if not 1 <= bits <= WORD_BITS:
        raise ValueError(f"bits must be between 1 and 32, got {bits}")
    data = values.to(torch.int64).movedim(dim, -1)
    if data.numel() and (int(data.min()) < 0 or int(data.max()) >= 2**bits):
        raise ValueError(f"values must lie in [0, {2**bits - 1}] to be packed as {bits}-bit")
    count = data.shape[-1]
    # One period of the pattern: `period` values fill exactly `period_words` words.
    period = WORD_BITS // math.gcd(bits, WORD_BITS)
    period_words = period * bits // WORD_BITS
    chunks = -(-count // period)
    padded = torch.zeros(*data.shape[:-1], chunks * period, dtype=torch.int64)
    padded[..., :count] = data
    padded = padded.reshape(*data.shape[:-1], chunks, period)
    words = torch.zeros(*data.shape[:-1], chunks, period_words, dtype=torch.int64)
    for j in range(period):
        word, shift = divmod(j * bits, WORD_BITS)
        words[..., word] |= (padded[..., j] << shift) & 0xFFFFFFFF
        if shift + bits > WORD_BITS:  # the value straddles into the next word
            words[..., word + 1] |= padded[..., j] >> (WORD_BITS - shift)
    words = words.reshape(*data.shape[:-1], chunks * period_words)[
        ..., : packed_length(count, bits)
    ]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def pack_int4_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Two signed int4 codes (``[-8, 7]``) per int8 along the last dimension (low nibble first).

    :raises ValueError: for an odd last dimension or codes out of the int4 range.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"the packed dimension must be even, got {codes.shape[-1]}")
    data = codes.to(torch.int16)
    if data.numel() and (int(data.min()) < -8 or int(data.max()) > 7):
        raise ValueError("int4 codes must lie in [-8, 7]")
    low = data[..., 0::2] & 0xF
    high = data[..., 1::2] & 0xF
    packed = low | (high << 4)
    return torch.where(packed >= 128, packed - 256, packed).to(torch.int8).contiguous()
