"""Error measures of the transform checks (pure numerics, float64 reductions).

Two questions, two measures:

* **does a tensor equal what it should be?** (:func:`max_relative_error`): the largest absolute
  difference relative to the largest magnitude of the expected tensor; the data-flow proofs ask
  it of a reader's input after its producer's channels were scaled.
* **does a layer still compute the same function?** (:func:`update_error`): the difference of the
  outputs relative to what the layer *adds* to its input (``output - input``, the residual
  update), in Frobenius norm. Relative to the output itself, a wrong branch would hide behind
  the residual stream (its massive activations reach hundreds where a branch adds units).
"""

from __future__ import annotations

import torch

__all__ = [
    "FLOW_TOLERANCE",
    "function_tolerance",
    "max_relative_error",
    "update_error",
]

#: Largest :func:`max_relative_error` of a data-flow proof (computed in float32 or wider: the
#: scaled tensors differ from the expected ones by float rounding only).
FLOW_TOLERANCE = 1e-4
#: Smallest update norm a layer may have for :func:`update_error` to divide by (a layer adding
#: nothing is compared to its output's norm instead).
_TINY = 1e-30


def _host64(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float64 on the host (devices without float64 never compute these)."""
    return tensor.detach().to("cpu", torch.float64)


def function_tolerance(weight_dtype: torch.dtype) -> float:
    """Largest :func:`update_error` accepted after a transform of weights stored in
    ``weight_dtype``: 1e-3 for 32- and 64-bit weights (the fold's float rounding is near 1e-6),
    2e-2 for 16-bit ones (the transformed weights are rounded to 8 or 11 bits again; measured
    near 3e-3). The outputs are computed in float32 either way."""
    return 1e-3 if torch.finfo(weight_dtype).bits >= 32 else 2e-2


def max_relative_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    """``max |got - expected| / max |expected|`` (0 when both are zero; inf when only
    ``expected`` is zero or the shapes differ)."""
    if expected.shape != got.shape:
        return float("inf")
    expected64 = _host64(expected)
    diff = float((_host64(got) - expected64).abs().max()) if got.numel() else 0.0
    scale = float(expected64.abs().max()) if expected.numel() else 0.0
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


def update_error(inputs: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> float:
    """``||after - before|| / ||before - inputs||`` (Frobenius norms, float64): how far a
    transformed layer's outputs moved, relative to what the original layer adds to its inputs.

    A layer whose output is not shaped like its input, or that adds nothing, is measured
    against ``||before||`` instead.
    """
    if before.shape != after.shape:
        return float("inf")
    before64 = _host64(before)
    moved = float(torch.linalg.vector_norm(_host64(after) - before64))
    if moved == 0.0:
        return 0.0
    reference = 0.0
    if inputs.shape == before.shape:
        reference = float(torch.linalg.vector_norm(before64 - _host64(inputs)))
    if reference <= _TINY:
        reference = float(torch.linalg.vector_norm(before64))
    return moved / reference if reference > _TINY else float("inf")
