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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msquant.quant.int_quant import compute_qparams, qrange

__all__ = [
    "ACT_BITS",
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
        """Widen the range with ``x``, then fake-quantize ``x`` with the updated parameters."""
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
