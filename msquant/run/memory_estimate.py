"""Estimate a run's peak host memory before any weight is loaded (``--max_memory``).

The estimate adds what the layer-wise run holds at its busiest moment, from the weightless model,
the checkpoint's size on disk and the calibration token count:

* weights: every decoder layer for ``model_wise``; the largest one (plus its quantized copy) for a
  streamed run; the modules outside the layer stack (embeddings, head) either way;
* calibration activations: the hidden states entering and leaving a layer, float32, for every
  calibration token (this process's share in a ``dp_layer_wise`` group);
* GPTQ: the Hessians of one layer (one ``in x in`` float32 matrix per linear layer, an upper
  bound: q/k/v and gate/up share theirs; MoE experts spread over the calibration passes of
  ``ext.experts_per_pass``) and the solve's working copies of the largest weight (three) and
  Hessian (two; see docs/performance.md).

It ignores the interpreter and libraries (a few hundred MiB) and is meant to stop a run that
cannot fit early, with the breakdown, rather than to predict the peak to the megabyte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from msquant.errors import MsquantInputError
from msquant.model.fused import parse_expert_linear
from msquant.model.layers import DecoderLayer

__all__ = ["MemoryEstimate", "check_memory", "checkpoint_size", "estimate_memory", "parse_memory"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
GIB = 2**30


def parse_memory(text: str) -> int:
    """Bytes from ``"64GiB"``, ``"500MB"``, ``"16g"`` or a plain byte count.

    :raises MsquantInputError: for anything else.
    """
    match = _PATTERN.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise MsquantInputError(
            f"--max_memory {text!r} is not a memory size; write e.g. 64GiB, 500MB or 16G"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per item at the run's busiest moment; ``total`` is their sum."""

    weights: int
    outside_layers: int
    activations: int
    gptq: int
    #: the model has MoE experts (their Hessians can be spread over more calibration passes)
    experts: bool = False

    @property
    def total(self) -> int:
        return self.weights + self.outside_layers + self.activations + self.gptq

    def describe(self) -> str:
        parts = (
            ("decoder layer weights", self.weights),
            ("embeddings and head", self.outside_layers),
            ("calibration activations", self.activations),
            ("GPTQ Hessians and solve", self.gptq),
        )
        return ", ".join(f"{label} {size / GIB:.2f} GiB" for label, size in parts)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def estimate_memory(
    meta_model: nn.Module,
    layers: list[DecoderLayer],
    checkpoint_bytes: int,
    *,
    streaming: bool,
    calibration_tokens: int,
    gptq: bool,
    gptq_passes: int = 1,
) -> MemoryEstimate:
    """The peak estimate for a run of ``meta_model`` (see the module docstring).

    :param gptq_passes: calibration passes per layer (the MoE experts' Hessians are spread
        over them; the other linears' are gathered in the first).
    """
    total_params = max(_numel(meta_model), 1)
    bytes_per_param = checkpoint_bytes / total_params
    layer_params = [_numel(layer.module) for layer in layers]
    outside = int((total_params - sum(layer_params)) * bytes_per_param)
    if streaming:
        # the float layer and its quantized copy (int8 codes + parameters: ~1.25 bytes/param)
        weights = int(max(layer_params, default=0) * (bytes_per_param + 1.25))
    else:
        weights = int(sum(layer_params) * bytes_per_param)
    hidden = max((_hidden_size(layer) for layer in layers), default=0)
    activations = 2 * calibration_tokens * hidden * 4
    solve = 0
    if gptq and layers:
        widest = max(layers, key=lambda layer: _numel(layer.module))
        linears = [linear for _, linear in widest.named_linears()]
        hessians = _hessian_bytes(widest, max(gptq_passes, 1))
        largest = max((lin.in_features * lin.out_features for lin in linears), default=0)
        widest_in = max((lin.in_features for lin in linears), default=0)
        solve = hessians + 3 * largest * 4 + 2 * widest_in**2 * 4
    experts = any(
        parse_expert_linear(name) for layer in layers for name, _ in layer.named_linears()
    )
    return MemoryEstimate(weights, outside, activations, solve, experts)


def _hessian_bytes(layer: DecoderLayer, passes: int) -> int:
    """Float32 Hessians alive at once: every non-expert linear's, and one pass's share of the
    experts' (the first pass holds both)."""
    dense = experts = 0
    for name, linear in layer.named_linears():
        size = linear.in_features**2 * 4
        if parse_expert_linear(name) is None:
            dense += size
        else:
            experts += size
    return dense + -(-experts // passes)


def _hidden_size(layer: DecoderLayer) -> int:
    """The width of the hidden states a layer reads: the smallest input width of its linears."""
    return min((linear.in_features for _, linear in layer.named_linears()), default=0)


def checkpoint_size(model_dir: Path) -> int:
    """Bytes of the model's safetensors files."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def check_memory(estimate: MemoryEstimate, limit: int, streaming: bool) -> None:
    """Refuse a run whose estimate exceeds ``limit`` bytes, saying what takes the memory.

    :raises MsquantInputError: with the breakdown and what to change.
    """
    if estimate.total <= limit:
        return
    hints = []
    if not streaming:
        hints.append("stream the layers (spec.runner: layer_wise)")
    hints += [
        "calibrate on fewer tokens (--max_calib_tokens or a smaller dataset)",
        "share the work over several processes (--nproc / --device npu:0,1,...)",
    ]
    if estimate.experts:
        hints.append("gather fewer experts' Hessians at a time (ext.experts_per_pass)")
    raise MsquantInputError(
        f"the run needs about {estimate.total / GIB:.2f} GiB ({estimate.describe()}), more than "
        f"--max_memory {limit / GIB:.2f} GiB; " + "; or ".join(hints)
    )
