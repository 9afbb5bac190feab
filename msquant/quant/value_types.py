"""The quantized value contract: what a stored code means, one class per kind of value.

Every quantized weight in msquant is ``codes`` plus per-group ``scale`` and ``offset`` over groups
of consecutive input columns (:class:`msquant.quant.quantized_weight.QuantizedWeight`), and its
float value is ``(decode(codes) - offset) * scale``. A :class:`ValueType` says what the codes are:

* :class:`IntValues` (``int8``, ``int4``, ... any width 2-8): signed integers stored as int8;
  ``decode`` is the identity; scales and offsets are computed by the quantization method
  (min/max, MSE, GPTQ, SSZ), any group size or per-channel.
* :class:`MXValues` (``mxfp8``, ``mxfp4``, OCP microscaling): uint8 codes of a small float
  element (e4m3, e2m1; :mod:`msquant.quant.minifloat`); ``scale`` is the block's power of two
  ``2^e`` (stored by formats as the E8M0 byte ``e + 127``), ``offset`` is 0, the group is the
  fixed block of 32. The value type quantizes by itself (:meth:`ValueType.quantize`, msModelSlim's
  numerics in :mod:`msquant.quant.mx_quant`) and fake-quantizes activations
  (:meth:`ValueType.fake_quantize`).
* :class:`FP8Values` (``fp8_e4m3``): uint8 bit patterns of torch's ``float8_e4m3fn``; one float32
  scale ``amax / 448`` per output channel (msModelSlim's ``fp8_e4m3`` ``per_channel`` ``minmax``),
  offset 0; the elements are the weight divided by it, saturated to +-448 and cast with torch's
  round-half-to-even ``float8_e4m3fn`` conversion. Activations: dynamic, one scale per token
  (:meth:`ValueType.fake_quantize` along the last dimension).

Schemes, plans, reports, savers, readers and verify name a value type by :attr:`ValueType.name`
(``qconfig``'s ``dtype`` spelling) and get the object from :func:`value_type_named`; adding a
value type is one subclass registered in :data:`VALUE_TYPES` (docs/value-types.md). The value
types live in the engine's quantization contracts (they are values, not processors): a format
that cannot store one refuses it by name (``Saver.stores_value_type``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from msquant.quant.minifloat import E2M1, E4M3, ElementFormat
from msquant.quant.mx_quant import BLOCK_SIZE, mx_fake_quantize, mx_quantize

__all__ = [
    "VALUE_TYPES",
    "IntValues",
    "MXValues",
    "FP8Values",
    "ValueType",
    "int_value_type",
    "value_type_named",
]


class ValueType(ABC):
    """What the codes of a quantized weight (or activation) are.

    :cvar family: ``int``, ``mx`` or ``fp8``: what a format checks it can store.
    """

    family: ClassVar[str]

    def __init__(self, name: str, bits: int, code_dtype: torch.dtype) -> None:
        #: ``qconfig``'s dtype spelling: ``int8``, ``mxfp4``.
        self.name = name
        #: Width of one code (the scheme name's W<bits>, the verify error bound).
        self.bits = bits
        #: The dtype codes are held in, in memory.
        self.code_dtype = code_dtype

    #: The scale block the value type fixes (MX: 32), or None when the method chooses.
    block_size: int | None = None
    #: Whether the value type computes its scales itself (:meth:`quantize`): methods then
    #: defer to it (MX); False when a method computes them (int).
    self_scaled: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueType) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    @abstractmethod
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """The float32 element value of every code (before offset and scale)."""

    @abstractmethod
    def code_problems(self, codes: torch.Tensor) -> list[str]:
        """What is wrong with stored ``codes`` (out of range, NaN codes), empty when nothing."""

    def error_bound(self) -> float:
        """Largest accepted ``||W - W_hat||_F / ||W||_F`` of an export (``msquant verify``):
        ``min(2^(3 - bits), 1.2)``, about four times the round-to-nearest error of Gaussian
        integer weights, while an unrelated matrix of the same scale lands near 1.41."""
        return min(2.0 ** (3 - self.bits), 1.2)

    def describe(self, group_size: int | None, symmetric: bool) -> str:
        """e.g. ``int4 group 32 sym``, ``mxfp8 block 32``."""
        scope = "per-channel" if group_size is None else f"group {group_size}"
        return f"{self.name} {scope} {'sym' if symmetric else 'asym'}"

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Quantize a 2-D weight by the value type's own rule (value types whose scales follow
        from the values alone, e.g. MX): ``(codes, scale, offset)``, groups of
        :attr:`block_size` (:meth:`msquant.quant.quantized_weight.QuantizedWeight.self_scaled`
        wraps them).

        :raises NotImplementedError: for value types whose scales a method computes (int).
        """
        raise NotImplementedError(f"{self.name} weights are quantized by a method")

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` quantized and dequantized dynamically along its last dimension (activations).

        :raises NotImplementedError: for value types without a dynamic activation rule here.
        """
        raise NotImplementedError(f"{self.name} has no dynamic activation rule")


class IntValues(ValueType):
    """Signed integer codes ``[-2^(b-1), 2^(b-1) - 1]`` held in int8 (msModelSlim's convention)."""

    family = "int"

    def __init__(self, bits: int) -> None:
        """:param bits: the width; the registry holds 2-8 (what the methods produce), other widths
        are representable (formats refuse them with their own message)."""
        super().__init__(f"int{bits}", bits, torch.int8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.float32)

    def code_problems(self, codes: torch.Tensor) -> list[str]:
        qmin, qmax = -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1
        outside = int(((codes < qmin) | (codes > qmax)).sum())
        return [f"{outside} code(s) outside the {self.bits}-bit range"] if outside else []


class MXValues(ValueType):
    """OCP MX: uint8 codes of ``element`` values, one power-of-two scale per block of 32 input
    columns, no offset (msModelSlim's ``per_block`` ``mxfp8`` / ``mxfp4``)."""

    family = "mx"
    block_size = BLOCK_SIZE
    self_scaled = True

    def __init__(self, name: str, element: ElementFormat, rule: str = "mxfp8") -> None:
        """:param rule: msModelSlim's rule for the exponents and the rounding
        (:data:`msquant.quant.mx_quant.MX_RULES`: ``mxfp8``, ``mxfp4``)."""
        super().__init__(name, element.bits, torch.uint8)
        self.element = element
        self.rule = rule
        self._table = element.decode(torch.arange(256) & ((1 << element.bits) - 1)).float()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self._table.to(codes.device)[codes.to(torch.int64)]

    def code_problems(self, codes: torch.Tensor) -> list[str]:
        problems = []
        wide = int((codes.to(torch.int64) >= (1 << self.bits)).sum())
        if wide:
            problems.append(f"{wide} code(s) wider than {self.bits} bits")
        nan = int(torch.isnan(self.decode(codes)).sum())
        if nan:
            problems.append(f"{nan} NaN {self.element.name} code(s)")
        return problems

    def describe(self, group_size: int | None, symmetric: bool) -> str:
        return f"{self.name} block {self.block_size}"

    def error_bound(self) -> float:
        """The relative step of the element's mantissa, ``2^-mantissa_bits`` (0.125 for e4m3,
        0.5 for e2m1): a normal element is within half of it of its value (MXFP8 Gaussian
        weights measure about 0.03, MXFP4 about 0.11)."""
        return 2.0**-self.element.mantissa_bits

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """msModelSlim's MX weight quantization (:func:`msquant.quant.mx_quant.mx_quantize`):
        e4m3 / e2m1 codes, ``scale = 2^e`` per block, offset 0.

        :raises ValueError: when ``in_features`` is not a multiple of 32 (msModelSlim pads the
            last block; no Ascend kernel reads such a layer) or a block's exponent overflows
            (non-finite weights).
        """
        _, in_features = weight.shape
        if in_features % BLOCK_SIZE:
            raise ValueError(
                f"{self.name} blocks are {BLOCK_SIZE} input columns; in_features {in_features} "
                "is not a multiple"
            )
        elements, exponents = mx_quantize(weight.detach(), self.element, self.rule)
        if not bool(torch.isfinite(exponents).all()):
            raise ValueError(
                f"{self.name}: a block's shared exponent overflows (weights not finite)"
            )
        scale = torch.pow(2.0, exponents)
        return self.element.encode(elements), scale, torch.zeros_like(scale)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        return mx_fake_quantize(x, self.element, self.rule)


class FP8Values(ValueType):
    """OCP FP8 E4M3 (torch's ``float8_e4m3fn``) elements with one float32 scale per output channel,
    no offset: msModelSlim's ``fp8_e4m3`` ``per_channel`` symmetric ``minmax`` weights (W8A8 fp8,
    its ``WFP8AFP8_DYNAMIC``) and compressed-tensors' ``float-quantized`` FP8 channel weights.

    Codes are the uint8 bit patterns of the float8 values (the storage formats view them as
    ``float8_e4m3fn``)."""

    family = "fp8"
    self_scaled = True
    #: The largest finite magnitude of ``float8_e4m3fn``.
    max_value = 448.0
    #: msModelSlim's floor on a channel's ``amax`` (an all-zero row gets a tiny, finite scale).
    min_amax = 1e-12

    def __init__(self, name: str) -> None:
        super().__init__(name, 8, torch.uint8)
        self._table = E4M3.decode(torch.arange(256)).float()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self._table.to(codes.device)[codes.to(torch.int64)]

    def code_problems(self, codes: torch.Tensor) -> list[str]:
        nan = int(torch.isnan(self.decode(codes)).sum())
        return [f"{nan} NaN float8_e4m3fn code(s)"] if nan else []

    def describe(self, group_size: int | None, symmetric: bool) -> str:
        return f"{self.name} per-channel"

    def error_bound(self) -> float:
        """The relative step of e4m3's 3-bit mantissa, ``2^-3``: a normal element is within half
        of it of its value (Gaussian weights measure about 0.02)."""
        return 2.0**-3

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """msModelSlim's FP8 per-channel weights (:func:`fp8_quantize_rows`): codes, float32
        ``scale`` ``[out, 1]``, offset 0.

        :raises ValueError: for non-finite weights (no finite scale).
        """
        if not bool(torch.isfinite(weight).all()):
            raise ValueError(f"{self.name}: the weight is not finite")
        elements, scale = fp8_quantize_rows(weight.detach())
        codes = elements.view(torch.uint8)
        scale = scale.to(torch.float32)
        return codes, scale, torch.zeros_like(scale)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic per-token FP8: each row along the last dimension scaled by its ``amax / 448``,
        rounded to ``float8_e4m3fn`` and scaled back (in ``x``'s dtype)."""
        shape = x.shape
        elements, scale = fp8_quantize_rows(x.reshape(-1, shape[-1]))
        return (elements.to(x.dtype) * scale).reshape(shape)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(elements, scale)`` of a 2-D tensor quantized to ``float8_e4m3fn`` one row at a time:
    ``scale = max(amax_row, 1e-12) / 448`` and ``elements = clamp(x / scale, -448, 448)`` cast to
    ``float8_e4m3fn`` (round half to even), computed in ``x``'s dtype as msModelSlim does
    (``calculate_fp8_qparam`` / ``fp8_quantize``); ``scale`` is ``[rows, 1]`` in ``x``'s dtype."""
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax.clamp(min=FP8Values.min_amax) / FP8Values.max_value
    scaled = (x / scale).clamp(min=-FP8Values.max_value, max=FP8Values.max_value)
    return scaled.to(torch.float8_e4m3fn), scale


#: Every value type by name (``qconfig``'s dtype spelling).
VALUE_TYPES: dict[str, ValueType] = {
    **{f"int{bits}": IntValues(bits) for bits in range(2, 9)},
    "mxfp8": MXValues("mxfp8", E4M3),
    "mxfp4": MXValues("mxfp4", E2M1, rule="mxfp4"),
    "fp8_e4m3": FP8Values("fp8_e4m3"),
}


def value_type_named(name: str) -> ValueType:
    """The registered value type ``name``.

    :raises ValueError: naming the known ones.
    """
    try:
        return VALUE_TYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown quantized value type {name!r}; known: {', '.join(VALUE_TYPES)}"
        ) from None


def int_value_type(bits: int) -> ValueType:
    """The integer value type of width ``bits`` (the registered one for 2-8)."""
    return VALUE_TYPES.get(f"int{bits}") or IntValues(bits)
