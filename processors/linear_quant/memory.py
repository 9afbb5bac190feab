"""What ``linear_quant`` holds while the run works on one decoder layer, for the memory estimate
of ``--max_memory`` (:meth:`msquant.plugin.Processor.memory_bytes`), on the weightless model.

* the quantized copy of the selected linears (int8 codes, float32 scale and offset per row or
  group), alive beside the float layer until the layer is released;
* calibrated methods (Hessian-based: ``gptq``, ``hessian_clip``): the calibration state of the
  busiest calibration pass (``ext.experts_per_pass`` and ``true_sequential`` spread the modules
  over passes), modules that read one tensor sharing theirs (q/k/v, gate/up: see
  :class:`~msquant.processors.linear_quant.calibration.HessianCollector`); and the largest
  module's solve or output-error check, whichever holds more;
* static activation ranges (W8A8): a fake-quantized copy of every selected weight, in the
  weight's dtype, hooked in for the calibration forward;
* otherwise: the largest module's rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from msquant.plugin import DecoderLayer, QuantMethod
from msquant.plugin.model import fused_groups
from msquant.processors.linear_quant.calibration import plan_passes
from msquant.processors.linear_quant.solve import OUTPUT_ERROR_COPIES, Selected

__all__ = ["SHARED_INPUT_GROUPS", "hessian_owners", "linear_quant_memory", "quantized_bytes"]

#: Fused matrices whose shards the layer's forward calls one after the other on the same input
#: tensor, so that the calibration collector gives them one Hessian (q/k/v, gate/up, Mixtral's
#: w1/w3). DeepSeek's ``fused_qkv_a_proj`` is not one: ``q_b_proj`` runs between its shards.
SHARED_INPUT_GROUPS = ("qkv_proj", "gate_up_proj", "w13")


def quantized_bytes(out_features: int, in_features: int, group_size: int | None) -> int:
    """Bytes of one quantized linear's weight: int8 codes and a float32 scale and offset per
    row (``group_size`` None) or per group of each row."""
    groups = 1 if group_size is None else math.ceil(in_features / group_size)
    return out_features * in_features + 8 * out_features * groups


def linear_quant_memory(
    layer: DecoderLayer,
    selected: Sequence[Selected],
    method: QuantMethod,
    static_activations: bool,
) -> dict[str, int]:
    """The items of the module docstring for ``layer``'s ``selected`` modules."""
    if not selected:
        return {}
    items = {
        "quantized weights": sum(
            quantized_bytes(m.out_features, m.in_features, scheme.group_size)
            for _, m, scheme in selected
        )
    }
    largest = max(selected, key=lambda s: s[1].out_features * s[1].in_features)[1]
    out_features, in_features = largest.out_features, largest.in_features
    if method.calibrated:
        items[f"{method.name} Hessians (busiest pass)"] = _hessian_bytes(layer, selected, method)
        check = OUTPUT_ERROR_COPIES * out_features * in_features * 4
        items[f"{method.name} solve and output errors (largest module)"] = max(
            method.work_bytes(out_features, in_features), check
        )
    else:
        items[f"{method.name} rounding (largest module)"] = method.work_bytes(
            out_features, in_features
        )
    if static_activations:
        items["fake-quantized weights (static activation ranges)"] = sum(
            m.out_features * m.in_features * m.weight.element_size() for _, m, _ in selected
        )
    return items


def hessian_owners(names: Sequence[str], plan: Mapping[str, int]) -> dict[str, str]:
    """For each module of ``names``, the module whose calibration state it uses: the first
    shard of a :data:`SHARED_INPUT_GROUPS` matrix gathered in the same pass (``plan``: module ->
    pass), else itself."""
    owner = {name: name for name in names}
    for group in fused_groups(names):
        if group.fused_name.rsplit(".", 1)[-1] in SHARED_INPUT_GROUPS:
            for member in group.members:
                if plan[member] == plan[group.members[0]]:
                    owner[member] = group.members[0]
    return owner


def _hessian_bytes(layer: DecoderLayer, selected: Sequence[Selected], method: QuantMethod) -> int:
    """The calibration state of the busiest pass: one per module, one per shared input."""
    names = [name for name, _, _ in selected]
    plan, _ = plan_passes(layer, names, method.true_sequential, method.experts_per_pass)
    owner = hessian_owners(names, plan)
    widths = {name: module.in_features for name, module, _ in selected}
    passes: dict[int, int] = {}
    for name in names:
        if owner[name] == name:
            passes[plan[name]] = passes.get(plan[name], 0) + method.quantizer_bytes(widths[name])
    return max(passes.values(), default=0)
