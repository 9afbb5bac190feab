"""What ``quarot`` holds while the run works on one decoder layer, for the memory estimate of
``--max_memory`` (:meth:`msquant.plugin.Processor.memory_bytes`).

* its rotation matrices, kept for the whole run: the residual stream's ``hidden x hidden`` and
  one ``width x width`` per per-head width (float32; float64 for a float64 model);
* an untied output head: a model whose head shares the embedding gets a head of its own;
* the largest working copy of one rotation: the weight in the compute dtype, its product with
  the rotation and the result in the weight's dtype, plus the rotation laid out block-diagonally
  over the whole rotated width when a per-head rotation is narrower (a value projection's rows,
  an output projection's columns: ``width^2`` values). The embedding and the head are rotated in
  ``setup``, the layer's linears in ``before_layer``; the larger of the two counts.
"""

from __future__ import annotations

import torch
from torch import nn

from msquant.plugin import DecoderLayer, adapter_for
from msquant.plugin.model import RotationLayout

__all__ = ["quarot_memory"]


def _weight(model: nn.Module, name: str) -> torch.Tensor:
    weight = getattr(model.get_submodule(name), "weight", None)
    assert isinstance(weight, torch.Tensor)
    return weight


def quarot_memory(model: nn.Module, layer: DecoderLayer) -> dict[str, int]:
    """The items of the module docstring for ``layer`` (none when the rotation does not apply)."""
    layout, _ = adapter_for(model).rotation_layout(model, [layer])
    if layout is None or not layout.layers:
        return {}
    embedding = _weight(model, layout.embedding)
    compute = 8 if embedding.dtype == torch.float64 else 4
    found = layout.layers[0]
    widths = [found.head_width] if found.value_output else []
    items = {
        "rotation matrices": compute * (layout.hidden_size**2 + sum(w * w for w in widths)),
    }
    if layout.tied:
        items["untied output head"] = embedding.numel() * embedding.element_size()
    items["working copies (largest rotation)"] = max(
        _rotation_bytes(embedding, compute, 0),
        _rotation_bytes(_weight(model, layout.head), compute, 0),
        _layer_working(model, layout, compute),
    )
    return items


def _rotation_bytes(weight: torch.Tensor, compute: int, block_width: int) -> int:
    """One rotation of ``weight``: its copy in the compute dtype, the product, the result, and a
    ``block_width``-wide block-diagonal rotation (0: none built)."""
    return weight.numel() * (2 * compute + weight.element_size()) + compute * block_width**2


def _layer_working(model: nn.Module, layout: RotationLayout, compute: int) -> int:
    """The largest rotation of the layer's linears (the norm folds copy less)."""
    found = layout.layers[0]
    largest = 0
    stream = [name for entry in found.norms for name in entry.readers] + list(found.writers)
    for name in stream:  # the stream's rotation is as wide as the stream: nothing laid out
        largest = max(largest, _rotation_bytes(_weight(model, name), compute, 0))
    head = found.head_width + found.value_skip
    for value, output in found.value_output:
        rows, columns = _weight(model, value), _weight(model, output)
        value_block = rows.shape[0] if rows.shape[0] > head else 0
        output_block = columns.shape[1] if columns.shape[1] > found.head_width else 0
        largest = max(
            largest,
            _rotation_bytes(rows, compute, value_block),
            _rotation_bytes(columns, compute, output_block),
        )
    return largest
