"""The one in-memory representation of a quantized linear weight that every exporter reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msquant.quant.int_quant import dequantize
from msquant.quant.value_types import ValueType, int_value_type

__all__ = ["QuantizedWeight"]


@dataclass(frozen=True)
class QuantizedWeight:
    """Codes plus per-channel or per-group parameters of one ``[out, in]`` weight.

    What a code means is its :class:`~msquant.quant.value_types.ValueType` (``value_type``,
    integer codes of width ``bits`` when not given): the float weight is
    ``(value_type.decode(codes) - offset) * scale``. The rest of this docstring describes the
    integer codes; MX codes are uint8 element codes with ``scale = 2^e`` per block of 32 and
    ``offset = 0`` (:class:`~msquant.quant.value_types.MXValues`).

    Conventions (msModelSlim's): ``codes`` are signed integers in ``[-2^(b-1), 2^(b-1)-1]`` stored as
    int8; ``offset`` is the signed zero point (all zeros when symmetric); the float weight is
    ``(codes - offset) * scale`` with ``scale`` and ``offset`` broadcast over each group of
    ``group_size`` consecutive input columns (one group spanning all columns for per-channel).

    :param codes: int8 tensor ``[out, in]``.
    :param scale: float32 tensor ``[out, in // group_size]`` (``[out, 1]`` per-channel).
    :param offset: float32 tensor of the same shape as ``scale``.
    :param bits: bit width of the codes (8 for int8).
    :param symmetric: whether the offset is identically zero by construction.
    :param group_size: group width over input columns, or ``None`` for per-channel.
    :param value_type: what the codes are; None: :func:`int_value_type` of ``bits``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    bits: int
    symmetric: bool
    group_size: int | None
    value_type: ValueType = None  # type: ignore[assignment]  # set from bits when None

    def __post_init__(self) -> None:
        if self.value_type is None:
            object.__setattr__(self, "value_type", int_value_type(self.bits))
        code_dtype = self.value_type.code_dtype
        if self.codes.dim() != 2 or self.codes.dtype != code_dtype:
            raise ValueError(
                f"codes must be a 2-D {str(code_dtype).removeprefix('torch.')} tensor, got "
                f"{self.codes.dtype} {tuple(self.codes.shape)}"
            )
        out_features, in_features = self.codes.shape
        groups = 1 if self.group_size is None else in_features // self.group_size
        expected = (out_features, groups)
        for name, tensor in (("scale", self.scale), ("offset", self.offset)):
            if tuple(tensor.shape) != expected or tensor.dtype != torch.float32:
                raise ValueError(
                    f"{name} must be float32 {expected}, got {tensor.dtype} {tuple(tensor.shape)}"
                )

    @classmethod
    def self_scaled(cls, weight: torch.Tensor, value_type: ValueType) -> QuantizedWeight:
        """``weight`` quantized by a value type that computes its own scales (MX,
        :attr:`ValueType.self_scaled`): symmetric, groups of its block."""
        codes, scale, offset = value_type.quantize(weight)
        return cls(codes, scale, offset, value_type.bits, True, value_type.block_size, value_type)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)`` of the weight."""
        out_features, in_features = self.codes.shape
        return int(out_features), int(in_features)

    @property
    def is_per_group(self) -> bool:
        """True for per-group parameters, False for per-channel."""
        return self.group_size is not None

    @property
    def num_groups(self) -> int:
        """Number of scale columns: ``in // group_size`` per-group, 1 per-channel."""
        return int(self.scale.shape[1])

    @property
    def effective_group_size(self) -> int:
        """Width of one group in input columns (``in_features`` for per-channel)."""
        return self.shape[1] if self.group_size is None else self.group_size

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes represent (the 'fake-quantized' weight)."""
        values = self.value_type.decode(self.codes)
        return dequantize(values, self.scale, self.offset, self.group_size)

    def unsigned_codes(self) -> torch.Tensor:
        """Codes shifted to ``[0, 2^b - 1]`` (int32): the GPTQ / compressed-tensors storage view.

        ``unsigned = codes + 2^(b-1)``; with :meth:`unsigned_zero_points` the weight is
        ``(unsigned - zero) * scale``, the same values as ``(codes - offset) * scale``.
        """
        return self.codes.to(torch.int32) + 2 ** (self.bits - 1)

    def unsigned_zero_points(self) -> torch.Tensor:
        """Zero points shifted to ``[0, 2^b - 1]`` (int32, shape of ``scale``).

        ``2^(b-1)`` everywhere when symmetric (GPTQ's implicit symmetric zero).
        :raises ValueError: when an offset is not an integer in the signed code range (such a
            zero point cannot be stored by integer formats).
        """
        qmin, qmax = -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
        rounded = torch.round(self.offset)
        if not torch.equal(rounded, self.offset) or rounded.min() < qmin or rounded.max() > qmax:
            raise ValueError(
                f"offsets must be integers in [{qmin}, {qmax}] to be stored as zero points"
            )
        return rounded.to(torch.int32) + 2 ** (self.bits - 1)

    def g_idx(self) -> torch.Tensor:
        """Group index of every input column (int32 ``[in]``): always ``i // group_size`` here,
        because act-order runs with static groups (a trivial g_idx, which vLLM requires)."""
        in_features = self.shape[1]
        return torch.arange(in_features, dtype=torch.int32) // self.effective_group_size
