"""The decoded form every format reader produces, and the checks common to all formats.

A :class:`DecodedLayer` uses msquant's signed convention whatever the file format: codes in
``[-2^(b-1), 2^(b-1)-1]``, a signed zero point ``offset``, and ``w = (codes - offset) * scale``
with the parameters of column ``i`` taken from group ``g_idx[i]``. Readers convert unsigned
storage (GPTQ, compressed-tensors: ``q + 2^(b-1)``) into it, so comparisons with the in-memory
:class:`msquant.plugin.QuantizedWeight` are direct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msquant.quant.value_types import ValueType, int_value_type
from msquant.verify.report import Findings

__all__ = ["DecodedLayer", "check_values", "signed_range", "trivial_g_idx"]


def signed_range(bits: int) -> tuple[int, int]:
    """``(-2^(b-1), 2^(b-1) - 1)``."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


@dataclass
class DecodedLayer:
    """One quantized linear read back from an export.

    :param name: module name.
    :param scheme: the format's name for the scheme (for the report).
    :param bits: code width.
    :param group_size: group width (``None`` when one group spans all input columns).
    :param codes: int32 signed codes ``[out, in]``.
    :param scale: float32 ``[out, G]`` (converted from the storage dtype).
    :param offset: float32 signed zero points ``[out, G]``.
    :param g_idx: int64 group of every input column ``[in]``.
    :param scale_dtype: dtype the scales are stored in (sets the tolerance against a reference).
    :param tensors: role (``codes``, ``scale``, ``offset``, ``g_idx``) -> stored tensor name, for
        messages.
    :param value_type: what the codes are (:mod:`msquant.quant.value_types`); None: the
        integers of ``bits`` (the signed convention above). MX codes are uint8 element codes,
        ``scale`` the blocks' powers of two, ``offset`` 0.
    """

    name: str
    scheme: str
    bits: int
    group_size: int | None
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    g_idx: torch.Tensor
    scale_dtype: torch.dtype
    tensors: dict[str, str]
    value_type: ValueType | None = None

    @classmethod
    def symmetric_per_channel(
        cls,
        name: str,
        scheme: str,
        codes: torch.Tensor,
        scale: torch.Tensor,
        *,
        scale_dtype: torch.dtype,
        tensors: tuple[str, str, str],
        value_type: ValueType | None = None,
    ) -> DecodedLayer:
        """An 8-bit layer with one scale per output channel and no zero point (the W8A8 and FP8
        layouts): ``scale`` ``[out, 1]`` taken as float32, a zero offset, every column in group 0.

        :param tensors: the stored names (or descriptions) of the codes, the scale and the
            offset, for messages.
        """
        codes_name, scale_name, offset_name = tensors
        in_features = int(codes.shape[1])
        scale = scale.to(torch.float32)
        return cls(
            name=name,
            scheme=scheme,
            bits=8,
            group_size=None,
            codes=codes,
            scale=scale,
            offset=torch.zeros_like(scale),
            g_idx=trivial_g_idx(in_features, in_features),
            scale_dtype=scale_dtype,
            tensors={
                "codes": codes_name,
                "scale": scale_name,
                "offset": offset_name,
                "g_idx": f"{name} (per-channel)",
            },
            value_type=value_type,
        )

    @classmethod
    def mx_blocks(
        cls,
        name: str,
        scheme: str,
        codes: torch.Tensor,
        scale: torch.Tensor,
        *,
        value_type: ValueType,
        block: int,
        tensors: tuple[str, str],
    ) -> DecodedLayer:
        """An MX layer (MXFP8 / MXFP4): ``codes`` ``[out, in]`` of ``value_type``, one power-of-two
        ``scale`` per block of ``block`` input columns (``[out, in / block]``, float32), no offset.

        :param tensors: the stored names of the codes and the scale, for messages.
        """
        codes_name, scale_name = tensors
        scale = scale.to(torch.float32)
        return cls(
            name=name,
            scheme=scheme,
            bits=value_type.bits,
            group_size=block,
            codes=codes,
            scale=scale,
            offset=torch.zeros_like(scale),
            g_idx=trivial_g_idx(int(codes.shape[1]), block),
            scale_dtype=torch.float32,
            tensors={
                "codes": codes_name,
                "scale": scale_name,
                "offset": f"{name} (no offset: MX)",
                "g_idx": f"{name} (blocks of {block})",
            },
            value_type=value_type,
        )

    @property
    def values(self) -> ValueType:
        """The codes' value type (integers of ``bits`` when not given)."""
        return int_value_type(self.bits) if self.value_type is None else self.value_type

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    @property
    def symmetric(self) -> bool:
        """True when every zero point is 0 (the symmetric one)."""
        return not bool(torch.count_nonzero(self.offset))

    @property
    def effective_group_size(self) -> int:
        """Group width in columns (``in_features`` when per-channel)."""
        return self.shape[1] if self.group_size is None else self.group_size

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``(decode(codes) - offset[:, g_idx]) * scale[:, g_idx]``."""
        index = self.g_idx.to(torch.int64)
        return (self.values.decode(self.codes) - self.offset[:, index]) * self.scale[:, index]


def check_values(layer: DecodedLayer, findings: Findings) -> bool:
    """Scales finite and positive, zero points finite and in the code range, g_idx in range.

    :returns: whether the layer can be dequantized meaningfully (no error recorded here).
    """
    before = len(findings.errors)
    scale_name = layer.tensors["scale"]
    finite = torch.isfinite(layer.scale)
    if not bool(finite.all()):
        findings.error(f"{scale_name}: {int((~finite).sum())} non-finite scale(s)")
    non_positive = finite & (layer.scale <= 0)
    if bool(non_positive.any()):
        findings.error(f"{scale_name}: {int(non_positive.sum())} scale(s) <= 0")
    offset_name = layer.tensors["offset"]
    qmin, qmax = signed_range(layer.bits)
    finite = torch.isfinite(layer.offset)
    if not bool(finite.all()):
        findings.error(f"{offset_name}: {int((~finite).sum())} non-finite zero point(s)")
    outside = finite & ((layer.offset < qmin) | (layer.offset > qmax))
    if bool(outside.any()):
        findings.error(
            f"{offset_name}: {int(outside.sum())} zero point(s) outside the {layer.bits}-bit code "
            f"range [{qmin}, {qmax}] (signed convention)"
        )
    for problem in layer.values.code_problems(layer.codes):
        findings.error(f"{layer.tensors['codes']}: {problem}")
    groups = int(layer.scale.shape[1])
    if layer.g_idx.numel() and (int(layer.g_idx.min()) < 0 or int(layer.g_idx.max()) >= groups):
        findings.error(
            f"{layer.tensors['g_idx']}: group indices outside [0, {groups - 1}] "
            f"(found {int(layer.g_idx.min())}..{int(layer.g_idx.max())})"
        )
    return len(findings.errors) == before


def trivial_g_idx(in_features: int, group_size: int) -> torch.Tensor:
    """``i // group_size`` for every input column (int64)."""
    return torch.arange(in_features, dtype=torch.int64) // group_size
