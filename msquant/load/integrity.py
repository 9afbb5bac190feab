"""Checks that the model msquant loaded is the checkpoint on disk, whole and finite.

transformers initialises a tensor the checkpoint lacks at random and drops one the model does not
have, reporting both only in a log table; msquant would then quantize and export a model that is
not the user's (a random output head, a re-initialised norm, half the layers). Every such
difference is an error here, naming the tensors. NaN or Inf in any loaded tensor (embeddings and
norms too, not only the linear weights quantization reads) is an error as well.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from msquant.errors import ModelLoadError
from msquant.quant.finite import non_finite_count, overflowing_values

__all__ = ["check_finite", "check_loading_info"]

_SHOWN = 6
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def _names(keys: Collection[str]) -> str:
    ordered = sorted(keys)
    shown = ", ".join(ordered[:_SHOWN])
    more = len(ordered) - _SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _layer_hint(missing: Collection[str], unexpected: Collection[str], config: Any) -> str:
    """A pointer at ``num_hidden_layers`` when whole layers look missing or extra."""
    declared = getattr(config, "num_hidden_layers", None)
    if not isinstance(declared, int):
        return ""
    extra = {int(m.group(1)) for k in unexpected if (m := _LAYER_INDEX.search(k))}
    absent = {int(m.group(1)) for k in missing if (m := _LAYER_INDEX.search(k))}
    if extra and min(extra) >= declared:
        return (
            f"; config.json says num_hidden_layers {declared}, the checkpoint holds layers up "
            f"to index {max(extra)}"
        )
    if absent and not unexpected and max(absent) == declared - 1:
        return (
            f"; config.json says num_hidden_layers {declared}: does the checkpoint hold that "
            "many layers?"
        )
    return ""


def check_loading_info(info: Mapping[str, Any], path: Path, config: Any = None) -> None:
    """Refuse a load that missed or dropped tensors (``from_pretrained(output_loading_info=True)``).

    :raises ModelLoadError: naming the missing tensors (the model needs them, the checkpoint lacks
        them) and the unexpected ones (the checkpoint holds them, the model has no place for them).
    """
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = [
        str(entry[0]) if isinstance(entry, tuple) else str(entry)
        for entry in info.get("mismatched_keys") or ()
    ]
    if not (missing or unexpected or mismatched):
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} tensor(s) the model needs are missing from the checkpoint "
            f"({_names(missing)})"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} tensor(s) of the checkpoint have no place in the model "
            f"({_names(unexpected)})"
        )
    if mismatched:
        parts.append(f"{len(mismatched)} tensor(s) have another shape ({_names(mismatched)})")
    raise ModelLoadError(
        f"the weights in {path} do not match the model its config.json describes: "
        + "; ".join(parts)
        + _layer_hint(missing, unexpected, config)
        + ". Loading it anyway would quantize random or missing weights; fix config.json "
        "(model_type, num_hidden_layers, ...) or the checkpoint files"
    )


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse NaN/Inf in any of ``tensors`` (name, tensor) as loaded from the checkpoint, and
    values so large (beyond 2^64) that the run's arithmetic would overflow on them: checked here,
    the message names the tensor that holds them, not a later module whose inputs overflowed.

    :raises ModelLoadError: naming the first tensor that holds one.
    """
    for name, tensor in tensors:
        bad = non_finite_count(tensor)
        if bad:
            raise ModelLoadError(
                f"{name}: the checkpoint's tensor {tuple(tensor.shape)} contains {bad} NaN/Inf "
                "value(s); fix the checkpoint before quantizing"
            )
        huge, largest = overflowing_values(tensor)
        if huge:
            raise ModelLoadError(
                f"{name}: the checkpoint's tensor {tuple(tensor.shape)} holds {huge} value(s) "
                f"larger than 2^64 in magnitude (the largest {largest:.3g}): their squares "
                "overflow float32, so the layer's outputs and the statistics the quantization "
                "gathers on them would be Inf; no trained weight is that large: fix the "
                "checkpoint before quantizing"
            )
