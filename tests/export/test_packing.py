"""Byte-level tests of msquant's packing helpers: small matrices with hand-computed words.

Expected words are written in hex (each hex digit is one 4-bit field, two digits one byte; 3-bit
values are read as octal digits) and converted to the signed int32 that is stored.
"""

from __future__ import annotations

import pytest
import torch
from gptq_reader import unpack_fields

from msquant.plugin.export import pack_int4_pairs, pack_int32, packed_length


def words(*unsigned: int) -> list[int]:
    """Unsigned 32-bit words as the two's-complement int32 values torch stores."""
    return [w - 2**32 if w >= 2**31 else w for w in unsigned]


def ints(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


# --- 4 bits -------------------------------------------------------------------------------


def test_4bit_along_dim1_lsb_first() -> None:
    packed = pack_int32(ints([[1, 2, 3, 4, 5, 6, 7, 8], [15, 0, 0, 0, 0, 0, 0, 0]]), 4, dim=1)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (2, 1)
    assert packed[:, 0].tolist() == words(0x87654321, 0x0000000F)


def test_4bit_along_dim0_packs_each_column() -> None:
    column0 = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0]
    column1 = [0, 0, 0, 0, 0, 0, 0, 15, 0, 0, 0, 0, 0, 0, 0, 0]
    packed = pack_int32(torch.tensor([column0, column1], dtype=torch.int32).t(), 4, dim=0)
    assert tuple(packed.shape) == (2, 2)
    assert packed.tolist() == [words(0x87654321, 0xF0000000), words(0x0FEDCBA9, 0x00000000)]


def test_4bit_partial_word_is_zero_padded() -> None:
    packed = pack_int32(ints([[1, 2, 3, 4, 5]]), 4, dim=1)
    assert packed.tolist() == [words(0x00054321)]


# --- 2 bits -------------------------------------------------------------------------------


def test_2bit_along_dim1() -> None:
    packed = pack_int32(ints([[0, 1, 2, 3] * 4, [3] + [0] * 15]), 2, dim=1)
    # 0,1,2,3 -> bits 11 10 01 00 = 0xE4 per byte
    assert packed[:, 0].tolist() == words(0xE4E4E4E4, 0x00000003)


def test_2bit_along_dim0() -> None:
    column = [3] + [0] * 14 + [1]  # value 15 lands in bits 30-31
    packed = pack_int32(torch.tensor([column], dtype=torch.int32).t(), 2, dim=0)
    assert tuple(packed.shape) == (1, 1)
    assert packed.tolist() == [words(0x40000003)]


# --- 8 bits -------------------------------------------------------------------------------


def test_8bit_along_dim1() -> None:
    packed = pack_int32(ints([[1, 2, 3, 4], [255, 0, 0, 128]]), 8, dim=1)
    assert packed[:, 0].tolist() == words(0x04030201, 0x800000FF)


def test_8bit_along_dim0() -> None:
    packed = pack_int32(ints([[0x12, 0xAB], [0x34, 0xCD], [0x56, 0xEF], [0x78, 0x01]]), 8, dim=0)
    assert packed.tolist() == [words(0x78563412, 0x01EFCDAB)]


# --- 3 bits: values straddle word boundaries ---------------------------------------------


def test_3bit_full_period_along_dim1() -> None:
    # Values 0..7 repeated: read as octal digits 0o76543210 (24 bits = 0xFAC688) four times, so the
    # 96-bit stream is 0xFAC688FAC688FAC688FAC688, split into words from the least significant end.
    packed = pack_int32(ints([[i % 8 for i in range(32)]]), 3, dim=1)
    assert tuple(packed.shape) == (1, 3)
    assert packed[0].tolist() == words(0x88FAC688, 0xC688FAC6, 0xFAC688FA)


@pytest.mark.parametrize(
    ("index", "value", "expected"),
    [
        (10, 0b101, (0x40000000, 0x00000001, 0)),  # bits 30, 31 | 32
        (10, 0b110, (0x80000000, 0x00000001, 0)),
        (21, 0b111, (0, 0x80000000, 0x00000003)),  # bits 63 | 64, 65
        (31, 0b101, (0, 0, 0xA0000000)),  # bits 93-95
    ],
)
def test_3bit_straddling_value(index: int, value: int, expected: tuple[int, int, int]) -> None:
    row = [0] * 32
    row[index] = value
    along_dim1 = pack_int32(ints([row]), 3, dim=1)
    along_dim0 = pack_int32(ints([row]).t(), 3, dim=0)
    assert along_dim1[0].tolist() == words(*expected)
    assert along_dim0[:, 0].tolist() == words(*expected)


def test_3bit_partial_period_keeps_only_needed_words() -> None:
    row = [0] * 10 + [0b101]  # 11 values = 33 bits -> 2 words
    assert pack_int32(ints([row]), 3, dim=1).tolist() == [words(0x40000000, 0x00000001)]


# --- lengths, round trips and errors -----------------------------------------------------


@pytest.mark.parametrize(
    ("count", "bits", "expected"), [(32, 3, 3), (11, 3, 2), (64, 4, 8), (5, 4, 1), (4, 8, 1)]
)
def test_packed_length(count: int, bits: int, expected: int) -> None:
    assert packed_length(count, bits) == expected


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_round_trip_through_independent_unpacker(bits: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(bits)
    shape = (64, 3) if dim == 0 else (3, 64)
    values = torch.randint(0, 2**bits, shape, generator=generator, dtype=torch.int32)
    packed = pack_int32(values, bits, dim)
    assert packed.shape[dim] == packed_length(64, bits)
    assert torch.equal(unpack_fields(packed, bits, 64, dim), values.long())


@pytest.mark.parametrize(
    ("values", "bits", "message"),
    [
        (torch.zeros(1, 8), 4, "integer tensor"),
        (torch.zeros(1, 8, dtype=torch.bool), 4, "integer tensor"),
        (torch.zeros(1, 8, dtype=torch.int32), 0, "between 1 and 32"),
        (torch.zeros(1, 8, dtype=torch.int32), 33, "between 1 and 32"),
        (torch.tensor([[0, -1]], dtype=torch.int32), 4, r"\[0, 15\]"),
        (torch.tensor([[16, 0]], dtype=torch.int32), 4, r"\[0, 15\]"),
        (torch.tensor([[4]], dtype=torch.int32), 2, r"\[0, 3\]"),
    ],
)
def test_pack_int32_rejects(values: torch.Tensor, bits: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_int32(values, bits, dim=1)


# --- int4 pairs (msModelSlim W4A16) ------------------------------------------------------


def test_int4_pairs_low_nibble_first() -> None:
    codes = torch.tensor([[1, -1, -8, 7], [0, 0, -1, -1]], dtype=torch.int8)
    packed = pack_int4_pairs(codes)
    assert packed.dtype == torch.int8 and tuple(packed.shape) == (2, 2)
    # 1 | 0xF << 4 = 0xF1 (-15); 0x8 | 0x7 << 4 = 0x78 (120); 0x00; 0xFF (-1)
    assert packed.tolist() == [[-15, 120], [0, -1]]


@pytest.mark.parametrize(
    ("codes", "message"),
    [
        (torch.zeros(2, 3, dtype=torch.int8), "must be even"),
        (torch.tensor([[8, 0]], dtype=torch.int8), r"\[-8, 7\]"),
        (torch.tensor([[0, -9]], dtype=torch.int8), r"\[-8, 7\]"),
    ],
)
def test_int4_pairs_rejects(codes: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_int4_pairs(codes)
