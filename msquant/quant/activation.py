"""Activation quantization numerics (int8, msModelSlim's conventions): pure functions and one
small observer.

Two activation schemes feed msModelSlim's W8A8 family:

* **per-tensor static** (W8A8): one ``input_scale`` / ``input_offset`` per linear layer, calibrated
  on the calibration set with :func:`msquant.quant.int_quant.compute_qparams` (min and max widened
  to include 0; symmetric ``max|x| / 127``, asymmetric ``(max - min) / 255`` with the signed zero
  point ``round(-min / scale) - 128``). msModelSlim calibrates *online*, which the exports of its
  26.1.0 pipeline establish (``tests/oracle``): sample by sample, each linear first widens its
  running min/max with the sample, then the sample's activations are fake-quantized with the
  parameters of the range seen so far and the weights are fake-quantized too, so a later layer
  (and a later linear of the same layer) is calibrated on the quantized outputs of the earlier
  ones. :class:`OnlineMinMax` reproduces that schedule; :func:`per_tensor_qparams` gives the
  parameters of a finished range.
* **per-token dynamic** (W8A8_DYNAMIC, W4A8_DYNAMIC): each token (row of the last dimension) gets
  its own symmetric scale ``max|x_token| / 127`` at run time; nothing about activations is
  exported. :func:`fake_quantize_per_token` simulates it.
* **pd_mix** (W8A8_MIX, msModelSlim's ``scope: pd_mix``, int8 asymmetric): one static per-tensor
  ``input_scale`` / ``input_offset`` per linear, calibrated as W8A8's (the running range over the
  calibration set), used by the *decode* steps, while the *prefill* steps quantize each token
  dynamically as W8A8_DYNAMIC does. Calibration runs prompts, i.e. prefill: the calibration
  forward (and ``msquant eval``) therefore simulates the per-token path, and the static range is
  observed on the unquantized inputs.
* **per-block dynamic** (MX: W8A8_MXFP8, W4A4_MXFP4, W4A8_MXFP): each block of 32 consecutive
  values along the last dimension gets its own power-of-two scale at run time, its values
  rounded to the value type's float element (:meth:`msquant.quant.value_types.ValueType.fake_quantize`,
  msModelSlim's numerics); nothing about activations is exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from msquant.quant.int_quant import compute_qparams, qrange
from msquant.quant.value_types import value_type_named

__all__ = [
    "ACT_BITS",
    "ActivationQuant",
    "OnlineMinMax",
    "fake_quantize_per_tensor",
    "fake_quantize_per_token",
    "per_tensor_qparams",
    "per_token_qparams",
]

#: Activations are int8 in every scheme msModelSlim exports for vLLM-Ascend's W8A8 family.
ACT_BITS = 8


def per_tensor_qparams(
    min_val: float, max_val: float, symmetric: bool, bits: int = ACT_BITS
) -> tuple[float, float]:
    """``(input_scale, input_offset)`` of a per-tensor activation range, computed in float32.

    The offset is the signed integral zero point (0 when symmetric); both are Python floats with
    float32 values, as msModelSlim stores them (float32 tensors of shape ``[1]``).
    """
    scale, offset = compute_qparams(
        torch.tensor(min_val, dtype=torch.float32),
        torch.tensor(max_val, dtype=torch.float32),
        bits,
        symmetric,
    )
    return float(scale), float(offset)


def fake_quantize_per_tensor(
    x: torch.Tensor, scale: float, offset: float, bits: int = ACT_BITS
) -> torch.Tensor:
    """``(clamp(round(x / scale + offset)) - offset) * scale`` in ``x``'s dtype, computed in float32."""
    qmin, qmax = qrange(bits)
    codes = torch.clamp(torch.round(x.float() / scale + offset), qmin, qmax)
    return ((codes - offset) * scale).to(x.dtype)


def per_token_qparams(x: torch.Tensor, bits: int = ACT_BITS) -> torch.Tensor:
    """Symmetric per-token scales of ``x`` (one per row of the last dimension), float32 with
    shape ``x.shape[:-1] + (1,)``."""
    flat = x.float()
    scale, _ = compute_qparams(
        flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True), bits, True
    )
    return scale


def fake_quantize_per_token(x: torch.Tensor, bits: int = ACT_BITS) -> torch.Tensor:
    """Simulate dynamic per-token int8 quantization: each token rounded on its own symmetric grid."""
    qmin, qmax = qrange(bits)
    scale = per_token_qparams(x, bits)
    codes = torch.clamp(torch.round(x.float() / scale), qmin, qmax)
    return (codes * scale).to(x.dtype)


@dataclass
class OnlineMinMax:
    """The running per-tensor range of one linear layer's input during calibration.

    :meth:`observe` widens the range with a batch and returns the batch fake-quantized with the
    parameters of the range seen so far (msModelSlim's online schedule, see the module docstring);
    :meth:`qparams` gives the final ``(input_scale, input_offset)``.
    """

    symmetric: bool
    bits: int = ACT_BITS
    min_val: float = 0.0
    max_val: float = 0.0
    batches: int = 0

    def observe(self, x: torch.Tensor) -> torch.Tensor:
        """Widen the range with ``x``, then fake-quantize ``x`` with the updated parameters
        (an empty batch, e.g. an MoE expert no token reached, is returned as it is)."""
        if x.numel() == 0:
            return x
        self.min_val = min(self.min_val, float(x.min()))
        self.max_val = max(self.max_val, float(x.max()))
        self.batches += 1
        scale, offset = self.qparams()
        return fake_quantize_per_tensor(x, scale, offset, self.bits)

    def qparams(self) -> tuple[float, float]:
        """``(input_scale, input_offset)`` of the range observed so far.

        :raises ValueError: before any batch was observed.
        """
        if self.batches == 0:
            raise ValueError("no activation was observed: run the calibration set through first")
        return per_tensor_qparams(self.min_val, self.max_val, self.symmetric, self.bits)


#: The activation scopes implemented: one static range per layer, or one scale per token at run time.
ActScope = Literal["per_tensor", "per_token", "pd_mix", "per_block"]


@dataclass(frozen=True)
class ActivationQuant:
    """How a quantized linear layer's input is quantized (int8), as the exports need it.

    ``per_tensor`` (W8A8, static): ``scale`` / ``offset`` are the calibrated ``input_scale`` /
    ``input_offset`` (float32 values; the offset is the signed integral zero point, 0 when
    symmetric). ``per_token`` (W8A8_DYNAMIC): symmetric, nothing calibrated (``scale`` and
    ``offset`` None): each token is scaled by ``max|x_token| / 127`` at run time. ``pd_mix``
    (W8A8_MIX): the static ``scale`` / ``offset`` of the decode steps (asymmetric) and per-token
    dynamic quantization in prefill (what :meth:`fake_quantize` simulates). ``per_block`` (MX):
    dynamic, symmetric, each block of 32 values scaled at run time, of ``value_type``
    (``mxfp8``, ``mxfp4``; ``bits`` is its width). ``per_token`` with ``value_type`` ``fp8_e4m3``
    (W8A8 fp8, msModelSlim's WFP8AFP8_DYNAMIC): each token scaled by ``amax / 448`` and rounded
    to ``float8_e4m3fn`` at run time.

    :raises ValueError: for a per-tensor scheme without its parameters, or an asymmetric or
        parametrised per-token one, or a per-block one without a block value type.
    """

    scope: ActScope
    symmetric: bool = True
    scale: float | None = None
    offset: float | None = None
    bits: int = ACT_BITS
    #: ``per_block`` (MX) and float ``per_token`` (fp8_e4m3) only: the value type's name
    #: (:mod:`msquant.quant.value_types`); None for int activations.
    value_type: str | None = None

    def __post_init__(self) -> None:
        if self.scope == "per_block":
            values = value_type_named(self.value_type or "")
            if values.block_size is None or self.scale is not None or self.offset is not None:
                raise ValueError(
                    f"per_block activations are dynamic with a block value type, got {values.name}"
                )
            object.__setattr__(self, "bits", values.bits)
            return
        if self.value_type is not None:
            values = value_type_named(self.value_type)
            if values.block_size is not None:  # MX value types go with per_block only
                raise ValueError(
                    f"{self.scope} activations are int{self.bits}, not {self.value_type}"
                )
            per_token_float = (
                self.scope == "per_token" and values.self_scaled and values.block_size is None
            )
            if not per_token_float or not self.symmetric or self.scale is not None:
                raise ValueError(
                    f"{self.scope} activations of {self.value_type}: a float value type goes with "
                    "dynamic symmetric per_token activations (fp8_e4m3) or per_block (MX) only"
                )
            object.__setattr__(self, "bits", values.bits)
            return
        if self.scope in ("per_tensor", "pd_mix"):
            if self.scope == "pd_mix" and self.symmetric:
                raise ValueError(
                    "pd_mix activations are asymmetric (msModelSlim's int8_pd_mix_asym)"
                )
            if self.scale is None or self.offset is None:
                raise ValueError("a per_tensor activation scheme needs its input scale and offset")
            if not self.scale > 0 or self.offset != round(self.offset):
                raise ValueError(
                    f"input scale {self.scale} must be > 0 and input offset {self.offset} integral"
                )
            if self.symmetric and self.offset != 0:
                raise ValueError("a symmetric activation scheme has input offset 0")
        elif self.scope == "per_token":
            if not self.symmetric or self.scale is not None or self.offset is not None:
                raise ValueError("per_token activations are symmetric and carry no parameters")
        else:
            raise ValueError(
                f"activation scope {self.scope!r}; valid: per_tensor, per_token, pd_mix, per_block"
            )

    @property
    def dynamic(self) -> bool:
        """Whether the scale is computed at run time (per token or block) rather than calibrated."""
        return self.scope in ("per_token", "per_block")

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` quantized and dequantized as the deployed kernel quantizes it (in ``x``'s dtype)."""
        if self.value_type is not None:
            return value_type_named(self.value_type).fake_quantize(x)
        if self.scope in ("per_token", "pd_mix"):  # pd_mix: its prefill path
            return fake_quantize_per_token(x, self.bits)
        assert self.scale is not None and self.offset is not None
        return fake_quantize_per_tensor(x, self.scale, self.offset, self.bits)

    def scheme_name(self, weight_bits: int) -> str:
        """msModelSlim's name of this activation scheme with ``weight_bits``-bit weights:
        ``W8A8`` (static), ``W8A8_DYNAMIC``, ``W4A8_DYNAMIC``, ``W8A8_MIX``; MX: ``W8A8_MXFP8``,
        ``W4A4_MXFP4``, ``W4A8_MXFP`` (msModelSlim's names; the names plans show)."""
        if self.value_type is not None and self.scope == "per_token":
            # msModelSlim's W8A8 fp8 type (fp8 per-channel weights, fp8 per-token activations)
            return "WFP8AFP8_DYNAMIC"
        if self.value_type is not None:
            # msModelSlim names a mixed-width MX scheme by the family alone (W4A8_MXFP)
            same = weight_bits == self.bits
            return f"W{weight_bits}A{self.bits}_MXFP" + (str(self.bits) if same else "")
        if self.scope == "pd_mix":
            return f"W{weight_bits}A{self.bits}_MIX"
        return f"W{weight_bits}A{self.bits}" + ("_DYNAMIC" if self.dynamic else "")

    def describe(self) -> str:
        """``a8 per_tensor asym`` and the like (plans, module reprs)."""
        kind = "sym" if self.symmetric else "asym"
        if self.value_type is not None:
            return f"a {self.value_type} {self.scope}"
        if self.scope == "pd_mix":
            return f"a{self.bits} pd_mix (prefill per_token, decode per_tensor {kind})"
        return (
            f"a{self.bits} {self.scope} {kind}" if not self.dynamic else f"a{self.bits} per_token"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready record (floats are float32 values, exact in JSON's doubles)."""
        record: dict[str, Any] = {
            "scope": self.scope,
            "symmetric": self.symmetric,
            "scale": self.scale,
            "offset": self.offset,
            "bits": self.bits,
        }
        if self.value_type is not None:
            record["value_type"] = self.value_type
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> ActivationQuant:
        """Inverse of :meth:`to_json`."""
        return cls(
            scope=record["scope"],
            symmetric=bool(record["symmetric"]),
            scale=record["scale"],
            offset=record["offset"],
            bits=int(record["bits"]),
            value_type=record.get("value_type"),
        )
