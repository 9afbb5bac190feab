"""The MX layer types of the Ascend format (msModelSlim 26.1.0's ``ascendv1`` saver): packing a
quantized linear and decoding it back (pure functions over tensors).

Per MX linear ``P`` (types ``W8A8_MXFP8``, ``W4A4_MXFP4``, ``W4A8_MXFP``; activations are
quantized per block at run time, nothing about them is stored):

* ``P.weight``: MXFP8: ``float8_e4m3fn`` ``[out, in]``, the elements; MXFP4: uint8
  ``[out, in / 2]``, two e2m1 codes per byte along the input features (element ``2i`` in the low
  nibble, sign in bit 3 of each nibble);
* ``P.weight_scale``: uint8 ``[out, in / 32]``, the E8M0 byte ``e + 127`` of each block's shared
  exponent ``e`` (the value is ``element * 2^e``);
* no ``P.weight_offset``; ``P.bias`` float32, typed ``FLOAT``;
* the description's global ``group_size`` is 32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from msquant.plugin import DecodedLayer, QuantizationError, QuantizedLinear, ValueType
from msquant.plugin.numerics import (
    e8m0_bytes,
    e8m0_scale,
    pack_nibbles,
    unpack_nibbles,
    value_type_named,
)

__all__ = [
    "MX_PARTS",
    "MX_TYPES",
    "STORAGE",
    "Storage",
    "mx_dtypes",
    "stored_columns",
    "decode_mx",
    "mx_module_tensors",
]

#: The MX types: description type -> (weight value type, activation value type).
MX_TYPES = {
    "W8A8_MXFP8": ("mxfp8", "mxfp8"),
    "W4A4_MXFP4": ("mxfp4", "mxfp4"),
    "W4A8_MXFP": ("mxfp4", "mxfp8"),
}
#: The stored tensors of an MX linear (the bias aside).
MX_PARTS = ("weight", "weight_scale")


class Storage(NamedTuple):
    """How the Ascend format stores an MX value type's codes ``[out, in]``."""

    #: codes (uint8) -> the stored weight.
    store: Callable[[torch.Tensor], torch.Tensor]
    #: the stored weight -> codes (uint8).
    load: Callable[[torch.Tensor], torch.Tensor]
    #: the stored weight's dtype.
    dtype: torch.dtype
    #: input features per stored column (2: two codes per byte).
    per_column: int


#: The storage of each MX value type (by name).
STORAGE = {
    "mxfp8": Storage(
        lambda codes: codes.view(torch.float8_e4m3fn),
        lambda weight: weight.view(torch.uint8),
        torch.float8_e4m3fn,
        1,
    ),
    "mxfp4": Storage(pack_nibbles, unpack_nibbles, torch.uint8, 2),
}


def mx_dtypes(kind: str) -> tuple[torch.dtype, torch.dtype]:
    """The stored dtypes of the MX type ``kind``'s :data:`MX_PARTS` (weight, weight_scale)."""
    return STORAGE[MX_TYPES[kind][0]].dtype, torch.uint8


def stored_columns(kind: str) -> int:
    """Input features per stored weight column of the MX type ``kind``."""
    return STORAGE[MX_TYPES[kind][0]].per_column


def mx_module_tensors(name: str, module: QuantizedLinear, kind: str) -> dict[str, torch.Tensor]:
    """The stored tensors of the MX linear ``name`` of type ``kind`` (module docstring).

    :raises QuantizationError: when MXFP4's ``in_features`` is odd (two codes per byte).
    """
    store, _, _, per_column = STORAGE[module.value_type.name]
    if module.in_features % per_column:
        raise QuantizationError(
            f"{name}: {kind} packs {per_column} codes per byte along in_features, which is "
            f"{module.in_features}; exclude this layer"
        )
    tensors = {
        f"{name}.weight": store(module.weight),
        f"{name}.weight_scale": e8m0_bytes(module.weight_scale),
    }
    if module.bias is not None:
        tensors[f"{name}.bias"] = module.bias.detach().float()
    return tensors


def decode_mx(
    name: str, kind: str, weight: torch.Tensor, stored_scale: torch.Tensor
) -> DecodedLayer | str:
    """The decoded MX linear ``name`` of type ``kind`` from its stored ``weight`` and
    ``weight_scale``, or what is wrong with them (shape or dtype)."""
    values: ValueType = value_type_named(MX_TYPES[kind][0])
    _, load, expected, per_column = STORAGE[values.name]
    if weight.dim() != 2 or weight.dtype != expected:
        return (
            f"{name}.weight: {kind} stores {str(expected).removeprefix('torch.')} "
            f"[out, in{'' if per_column == 1 else ' / 2'}], got {weight.dtype} {list(weight.shape)}"
        )
    codes = load(weight)
    out_features, in_features = codes.shape
    block = values.block_size
    assert block is not None
    blocks = (out_features, in_features // block)
    if (
        in_features % block
        or stored_scale.dtype != torch.uint8
        or tuple(stored_scale.shape) != blocks
    ):
        return (
            f"{name}.weight_scale: {kind} stores uint8 E8M0 [out, in / {block}] = {list(blocks)}, "
            f"got {stored_scale.dtype} {list(stored_scale.shape)}"
        )
    return DecodedLayer.mx_blocks(
        name,
        kind,
        codes,
        e8m0_scale(stored_scale),
        value_type=values,
        block=block,
        tensors=(f"{name}.weight", f"{name}.weight_scale"),
    )
