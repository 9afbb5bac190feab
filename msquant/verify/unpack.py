"""Unpackers for the packed integer layouts, written from the format specifications only.

They are deliberately independent of :mod:`msquant.export.packing`: verification must not share
code (and therefore bugs) with the exporters it checks.

* int32 words, LSB first (GPTQ ``qweight``/``qzeros``, compressed-tensors ``weight_packed`` and
  ``weight_zero_point``): the words along a dimension form one bit stream, bit ``k`` of the
  stream being bit ``k % 32`` of word ``k // 32``; value ``i`` is stream bits ``[i*b, (i+1)*b)``
  (so 3-bit values may straddle two words).
* int4 pairs in int8 (msModelSlim W4A16): byte ``j`` holds signed code ``2j`` in its low nibble
  and code ``2j + 1`` in its high nibble.
"""

from __future__ import annotations

import torch

__all__ = ["unpack_int32_stream", "unpack_int4_pairs", "words_needed"]

WORD = 32
CHUNK_VALUES = 2**22  # values unpacked per step (about 32 MiB of int64 temporaries each)


def words_needed(count: int, bits: int) -> int:
    """int32 words needed for ``count`` values of ``bits`` bits (the last word zero-padded)."""
    total_bits = count * bits
    return total_bits // WORD + (1 if total_bits % WORD else 0)


def unpack_int32_stream(
    words: torch.Tensor, bits: int, count: int, dim: int
) -> tuple[torch.Tensor, bool]:
    """Unsigned ``bits``-wide values stored densely, LSB first, in int32 ``words`` along ``dim``.

    :param words: int32 tensor whose ``dim`` has exactly :func:`words_needed` entries.
    :param count: number of values to read along ``dim``.
    :returns: ``(values, padding_clean)``: int32 values in ``[0, 2^bits - 1]`` with ``dim`` of
        length ``count``, and whether the unused bits after the last value are all zero.
    :raises ValueError: when ``words`` has the wrong length along ``dim``.
    """
    stream = words.movedim(dim, -1)
    length = stream.shape[-1]
    if length != words_needed(count, bits):
        raise ValueError(
            f"{length} words along dim {dim}, expected {words_needed(count, bits)} "
            f"for {count} {bits}-bit values"
        )
    rows = stream.reshape(-1, length)
    start = torch.arange(count, dtype=torch.int64) * bits
    word, shift = start // WORD, start % WORD
    crossing = shift + bits > WORD  # such a value takes its high bits from the next word
    next_word = torch.clamp(word + 1, max=max(length - 1, 0))
    values = torch.empty(rows.shape[0], count, dtype=torch.int32)
    step = max(1, CHUNK_VALUES // max(count, 1))  # bounds the int64 temporaries
    for first in range(0, rows.shape[0], step):
        chunk = (
            rows[first : first + step].to(torch.int64) & 0xFFFFFFFF
        )  # two's complement -> unsigned
        if WORD % bits == 0:  # whole values per word: split every word into its fields
            fields = chunk.unsqueeze(-1) >> torch.arange(0, WORD, bits, dtype=torch.int64)
            fields = fields.reshape(chunk.shape[0], -1)[:, :count]
            values[first : first + step] = (fields & ((1 << bits) - 1)).to(torch.int32)
            continue
        gathered = chunk[:, word] >> shift
        if bool(crossing.any()):
            high = chunk[:, next_word] << (WORD - shift)
            gathered |= torch.where(crossing, high, torch.zeros_like(high))
        values[first : first + step] = (gathered & ((1 << bits) - 1)).to(torch.int32)
    used = count * bits % WORD
    padding_clean = True
    if used and rows.numel():
        padding_clean = bool(((rows[:, -1].to(torch.int64) & 0xFFFFFFFF) >> used == 0).all())
    return values.reshape(*stream.shape[:-1], count).movedim(-1, dim), padding_clean


def unpack_int4_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes (int16, ``[-8, 7]``) from int8 bytes along the last dimension.

    The last dimension doubles: byte ``j`` gives codes ``2j`` (low nibble) and ``2j + 1``.
    """
    unsigned = packed.to(torch.int16) & 0xFF
    nibbles = torch.stack((unsigned & 0xF, unsigned >> 4), dim=-1)
    signed = nibbles - 16 * (nibbles >= 8).to(torch.int16)
    return signed.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
