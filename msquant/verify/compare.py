"""Comparisons of a decoded export with the in-memory result and with the original float model.

* Against a reference (:class:`msquant.plugin.QuantizedWeight` per module, the run's own result): codes
  bit for bit, zero points exactly, scales within the rounding of the dtype they are stored in.
* Against the original model: the relative Frobenius error ``||W - W_hat|| / ||W||`` of every
  layer, held to :func:`relative_error_bound`, and every float tensor the export keeps must be the
  original cast to its stored dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from msquant.errors import ModelLoadError
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.quant.value_types import int_value_type
from msquant.verify.fused_experts import split_fused_experts
from msquant.verify.layer import DecodedLayer
from msquant.verify.report import Findings, LayerReport
from msquant.verify.tensors import TensorStore, open_weights

__all__ = [
    "relative_error_bound",
    "scale_tolerance",
    "compare_reference",
    "compare_original",
    "compare_float_tensor",
    "open_original",
    "missing_modules",
]


def relative_error_bound(bits: int) -> float:
    """Largest accepted ``||W - W_hat||_F / ||W||_F`` for a ``bits``-wide export.

    ``min(2^(3 - bits), 1.2)``: 0.031 at 8 bits, 0.5 at 4 bits, 1.0 at 3 bits, 1.2 at 2 bits. That
    is about four times the round-to-nearest error of Gaussian weights per channel (0.0075 at 8
    bits, 0.135 at 4, 0.32 at 3), room for GPTQ (which trades weight error for output error) and
    for outliers, while an unrelated matrix of the same scale (a transposed square weight, swapped
    nibbles, codes read with the wrong layout) lands near sqrt(2) = 1.41 and fails at any width.
    """
    return int_value_type(bits).error_bound()


def scale_tolerance(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Allowed ``|stored - reference|`` for scales stored in ``dtype``: one relative epsilon of
    ``dtype`` plus its smallest subnormal (a rounding of the float32 reference, never more)."""
    info = torch.finfo(dtype)
    return reference.abs() * info.eps + info.smallest_normal * info.eps


def compare_reference(
    layer: DecodedLayer, reference: QuantizedWeight, entry: LayerReport, findings: Findings
) -> None:
    """Codes, zero points, scales and scheme of ``layer`` against the in-memory result."""
    name = layer.name
    if tuple(reference.shape) != layer.shape:
        findings.error(
            f"{layer.tensors['codes']}: decodes to shape {list(layer.shape)} but the in-memory "
            f"result of {name} is {list(reference.shape)}"
        )
        return
    if reference.bits != layer.bits:
        findings.error(f"{name}: stored as {layer.bits}-bit, in memory {reference.bits}-bit")
        return
    if reference.value_type != layer.values:
        findings.error(
            f"{name}: stored as {layer.values.name}, in memory {reference.value_type.name}"
        )
        return
    if reference.effective_group_size != min(layer.effective_group_size, layer.shape[1]):
        findings.error(
            f"{name}: stored with group width {layer.effective_group_size}, in memory "
            f"{reference.effective_group_size}"
        )
        return
    diff = (layer.codes.to(torch.int32) - reference.codes.to(torch.int32)).abs()
    entry.max_code_mismatch = int(diff.max()) if diff.numel() else 0
    if entry.max_code_mismatch:
        findings.error(
            f"{layer.tensors['codes']}: {int(torch.count_nonzero(diff))} code(s) differ from the "
            f"in-memory result (max |diff| {entry.max_code_mismatch})"
        )
    reference_groups = torch.arange(layer.shape[1]) // reference.effective_group_size
    if not torch.equal(layer.g_idx.to(torch.int64), reference_groups):
        findings.error(f"{layer.tensors['g_idx']}: group order differs from the in-memory result")
        return
    if tuple(layer.scale.shape) != tuple(reference.scale.shape):
        findings.error(
            f"{layer.tensors['scale']}: {list(layer.scale.shape)} parameters, in memory "
            f"{list(reference.scale.shape)}"
        )
        return
    if not torch.equal(layer.offset, reference.offset):
        count = int((layer.offset != reference.offset).sum())
        findings.error(
            f"{layer.tensors['offset']}: {count} zero point(s) differ from the in-memory result"
        )
    tolerance = scale_tolerance(reference.scale, layer.scale_dtype)
    too_far = (layer.scale - reference.scale).abs() > tolerance
    if bool(too_far.any()):
        findings.error(
            f"{layer.tensors['scale']}: {int(too_far.sum())} scale(s) differ from the in-memory "
            f"result by more than {str(layer.scale_dtype).replace('torch.', '')} rounding"
        )


def compare_original(
    layer: DecodedLayer, original: torch.Tensor, entry: LayerReport, findings: Findings
) -> None:
    """Relative error of the dequantized layer against its original float weight."""
    if tuple(original.shape) != layer.shape:
        findings.error(
            f"{layer.tensors['codes']}: decodes to shape {list(layer.shape)} but the original "
            f"{layer.name}.weight is {list(original.shape)} (transposed or mis-packed?)"
        )
        return
    weight = original.to(torch.float32)
    norm = float(weight.norm())
    error = float((layer.dequantize() - weight).norm())
    entry.relative_error = error / norm if norm > 0 else (0.0 if error == 0 else float("inf"))
    entry.error_bound = layer.values.error_bound()
    if not entry.relative_error <= entry.error_bound:
        findings.error(
            f"{layer.tensors['codes']}: relative error {entry.relative_error:.3g} against the original "
            f"{layer.name}.weight exceeds {entry.error_bound:.3g} for {layer.bits} bits "
            "(transposed, mis-packed or wrong scales?)"
        )


def compare_float_tensor(
    name: str, stored: torch.Tensor, original: torch.Tensor, findings: Findings
) -> None:
    """A tensor kept in float must be the original cast to the stored dtype, exactly."""
    if tuple(stored.shape) != tuple(original.shape):
        findings.error(
            f"{name}: shape {list(stored.shape)} differs from the original {list(original.shape)}"
        )
        return
    if stored.dtype.is_floating_point != original.dtype.is_floating_point:
        findings.error(f"{name}: dtype {stored.dtype} but the original is {original.dtype}")
        return
    expected = original.to(stored.dtype)
    if not torch.equal(stored, expected):
        findings.error(f"{name}: values differ from the original (cast to {stored.dtype})")


def open_original(model_path: str | Path) -> TensorStore:
    """The original model's weights (``model.safetensors`` or shards + index), experts it
    stores fused listed one tensor per expert projection (:func:`split_fused_experts`).

    :raises ModelLoadError: when the folder or its weights cannot be read.
    """
    directory = Path(model_path)
    if not directory.is_dir():
        raise ModelLoadError(
            f"model path {directory} is not a folder; pass the original model folder"
        )
    findings = Findings()
    store = open_weights(directory, "model", findings)
    if store is None or findings.errors:
        raise ModelLoadError(
            f"cannot read the original weights in {directory}: " + "; ".join(findings.errors)
        )
    return split_fused_experts(store)  # experts stored fused: compared expert by expert


def missing_modules(
    exported: list[str], reference: Mapping[str, QuantizedWeight], findings: Findings
) -> None:
    """Every reference module must be exported quantized, and vice versa."""
    for name in sorted(set(reference) - set(exported)):
        findings.error(f"{name}: quantized in memory but not stored quantized in the export")
    for name in sorted(set(exported) - set(reference)):
        findings.error(f"{name}: stored quantized but not quantized in memory")
