"""Estimate a run's peak host memory before any weight is loaded (``--max_memory``).

The estimate walks the weightless model's decoder layers and, for each, adds what the run holds
while it works on that layer; the busiest layer's sum is the estimate. The runner's own share:

* weights: every decoder layer for ``model_wise``; the layer itself for a streamed run; the
  modules outside the layer stack (embeddings, head) either way, at the checkpoint's bytes per
  parameter;
* when a processor calibrates: the hidden states entering and leaving the layer (every
  calibration token of this process, the model's dtype); the layer's other call arguments (an
  attention mask per batch, at most tokens x longest sample, and the rotary tables); one batch's
  forward through the layer (three activations as wide as its widest linear output).

Each processor adds what it holds on top (:meth:`msquant.plugin.Processor.memory_bytes`): a
quantizing processor its quantized copy of the layer, Hessians (only for methods that keep them,
and only those of one calibration pass), static activation ranges' fake-quantized weights,
smoothing statistics and search rows, rotation matrices, and the largest working copy of a
solve, a rounding or a fold. The processors' shares are summed, although those of a processor
that rewrites the layer are freed before the processors after it start (an upper bound).

It ignores the interpreter and libraries (a few hundred MiB) and the output head stage of
``lm_head: true``; it is meant to stop a run that cannot fit early, with the breakdown, rather
than to predict the peak to the megabyte.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from msquant.contracts.memory import CalibrationSize
from msquant.contracts.processor import Processor
from msquant.errors import MsquantInputError
from msquant.model.fused import parse_expert_linear
from msquant.model.layers import DecoderLayer

__all__ = [
    "MemoryEstimate",
    "calibration_size",
    "check_memory",
    "checkpoint_size",
    "estimate_memory",
    "format_size",
    "parse_memory",
]

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
    """What the run holds while it works on its busiest decoder layer, item by item (bytes).

    :param items: ``(what, bytes)`` in the order the estimate adds them: the runner's items,
        then each processor's, named ``"<processor type>: <what>"``.
    :param layer: the busiest decoder layer's name.
    :param experts: the model has MoE experts (their Hessians can be spread over more
        calibration passes).
    :param streamed: the decoder layers are streamed from disk (else all are loaded).
    """

    items: tuple[tuple[str, int], ...]
    layer: str = ""
    experts: bool = False
    streamed: bool = True

    @property
    def total(self) -> int:
        """The estimate: the sum of the items."""
        return sum(size for _, size in self.items)

    def get(self, what: str) -> int:
        """The bytes of item ``what`` (0 when the estimate has none)."""
        return sum(size for label, size in self.items if label == what)

    def describe(self) -> str:
        """The items over 0 bytes, e.g. ``"decoder layer weights 21.36 GiB, ..."``."""
        return ", ".join(f"{label} {format_size(size)}" for label, size in self.items if size)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (``msquant plan --max_memory --json``)."""
        return {
            "total_bytes": self.total,
            "layer": self.layer,
            "items": [{"what": label, "bytes": size} for label, size in self.items],
        }

    def table(self) -> str:
        """The items over 0 bytes, one per line, and the total."""
        shown = [(label, size) for label, size in self.items if size]
        width = max((len(label) for label, _ in shown), default=0)
        lines = [f"  {label:<{width}}  {format_size(size):>11}" for label, size in shown]
        lines.append(f"  {'total':<{width}}  {format_size(self.total):>11}")
        return "\n".join(lines)


def format_size(size: int) -> str:
    """``size`` bytes in GiB from 1 GiB up (``"38.60 GiB"``), else in MiB (``"12.3 MiB"``)."""
    if size >= GIB:
        return f"{size / GIB:.2f} GiB"
    return f"{size / 2**20:.1f} MiB"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def estimate_memory(
    meta_model: nn.Module,
    layers: Sequence[DecoderLayer],
    checkpoint_bytes: int,
    processors: Sequence[Processor],
    *,
    streaming: bool,
    calibration: CalibrationSize | None,
) -> MemoryEstimate:
    """The peak estimate for a run of ``processors`` on ``meta_model`` (see the module docstring).

    :param checkpoint_bytes: the size of the model's weights on disk (their bytes per parameter
        are the loaded model's).
    :param calibration: the calibration set's size, None when no processor calibrates.
    """
    total_params = max(_numel(meta_model), 1)
    bytes_per_param = checkpoint_bytes / total_params
    layer_params = [_numel(layer.module) for layer in layers]
    outside = int((total_params - sum(layer_params)) * bytes_per_param)
    whole_stack = int(sum(layer_params) * bytes_per_param)
    size = calibration or CalibrationSize(0, 0, 0, _dtype_bytes(meta_model))
    busiest: tuple[int, str, list[tuple[str, int]]] = (-1, "", [])
    for layer, params in zip(layers, layer_params, strict=True):
        items = [
            ("decoder layer weights", int(params * bytes_per_param) if streaming else whole_stack),
            ("embeddings and head", outside),
        ]
        if calibration is not None and calibration.tokens:
            items += _calibration_items(meta_model, layer, calibration)
        items += _processor_items(processors, meta_model, layer, size)
        total = sum(size for _, size in items)
        if total > busiest[0]:
            busiest = (total, layer.name, items)
    experts = any(
        parse_expert_linear(name) for layer in layers for name, _ in layer.named_linears()
    )
    return MemoryEstimate(tuple(busiest[2]), busiest[1], experts, streaming)


def _processor_items(
    processors: Sequence[Processor],
    model: nn.Module,
    layer: DecoderLayer,
    calibration: CalibrationSize,
) -> list[tuple[str, int]]:
    """Each processor's items for ``layer``, named ``"<type>: <what>"`` (two entries of one
    type add up)."""
    items: dict[str, int] = {}
    for processor in processors:
        for what, size in processor.memory_bytes(model, layer, calibration).items():
            label = f"{processor.type_name}: {what}"
            items[label] = items.get(label, 0) + int(size)
    return list(items.items())


def _calibration_items(
    model: nn.Module, layer: DecoderLayer, calibration: CalibrationSize
) -> list[tuple[str, int]]:
    """The runner's memory for calibrating ``layer``: hidden states in and out, the layer's call
    arguments, one batch's forward."""
    tokens, value = calibration.tokens, calibration.dtype_bytes
    widest = max((linear.out_features for _, linear in layer.named_linears()), default=0)
    masks = tokens * calibration.longest * value
    rotary = 2 * tokens * _head_width(model) * value
    return [
        ("calibration hidden states (in and out)", 2 * tokens * _hidden_width(model) * value),
        ("layer call arguments (attention masks, rotary tables)", masks + rotary),
        ("layer forward (one batch)", 3 * calibration.batch_tokens * widest * value),
    ]


def _hidden_width(model: nn.Module) -> int:
    """The width of the hidden states between decoder layers: the input embeddings'."""
    embeddings = _input_embeddings(model)
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[1])
    return int(getattr(_text_config(model), "hidden_size", 0) or 0)


def _head_width(model: nn.Module) -> int:
    """The widest rotary table a layer is called with: the config's head width (or rotary
    head width), else hidden size over heads."""
    config = _text_config(model)
    widths = [getattr(config, key, None) for key in ("head_dim", "qk_rope_head_dim")]
    found = [w for w in widths if isinstance(w, int) and w > 0]
    if found:
        return max(found)
    heads = getattr(config, "num_attention_heads", None)
    hidden = _hidden_width(model)
    return hidden // heads if isinstance(heads, int) and heads > 0 else hidden


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def _dtype_bytes(model: nn.Module) -> int:
    """Bytes of one value of the model's activations: its input embeddings' dtype (the model is
    loaded in its config's dtype, as the weightless copy is built)."""
    embeddings = _input_embeddings(model)
    weight = getattr(embeddings, "weight", None)
    if weight is not None and weight.is_floating_point():
        return int(weight.element_size())
    return 4


def calibration_size(
    model: nn.Module, sample_lengths: Sequence[int], world_size: int, batch_tokens: int
) -> CalibrationSize:
    """What one process of ``world_size`` calibrates on, from the samples' lengths in tokens.

    :param batch_tokens: the runner's tokens per batch (0: one sample at a time).
    """
    tokens = sum(sample_lengths)
    longest = max(sample_lengths, default=0)
    share = -(-tokens // max(world_size, 1))
    batch = longest if batch_tokens == 0 else max(batch_tokens, longest)
    return CalibrationSize(share, longest, min(batch, share), _dtype_bytes(model))


def checkpoint_size(model_dir: Path) -> int:
    """Bytes of the model's safetensors files."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def check_memory(estimate: MemoryEstimate, limit: int) -> None:
    """Refuse a run whose estimate exceeds ``limit`` bytes, saying what takes the memory.

    :raises MsquantInputError: with the breakdown and what to change.
    """
    if estimate.total <= limit:
        return
    hints = []
    if not estimate.streamed:
        hints.append("stream the layers (spec.runner: layer_wise)")
    hints += [
        "calibrate on fewer tokens (--max_calib_tokens or a smaller dataset)",
        "share the work over several processes (--nproc / --device npu:0,1,...)",
    ]
    if estimate.experts:
        hints.append("gather fewer experts' Hessians at a time (ext.experts_per_pass)")
    raise MsquantInputError(
        f"the run needs about {format_size(estimate.total)} ({estimate.describe()}), more than "
        f"--max_memory {format_size(limit)}; " + "; or ".join(hints)
    )
