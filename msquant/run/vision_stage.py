"""The vision stage of a run: a vision-language model's vision tower and projector linears
quantized without calibration data, when a ``spec.process`` entry selects them.

msquant calibrates on text (:mod:`msquant.model.vision`), so no calibration data reaches the
vision tower; the plan admits an entry selecting linears there only when their scheme is
data-free (weights from themselves by a data-free method, activations float or dynamic
per-token; :func:`msquant.planning.vision_scopes.vision_scope_errors`). This stage then presents
each vision part (the tower, the projector) to the quantizing entries and the savers as one
more layer, with ``before_layer`` and ``after_layer`` and no calibration pass between them, so
the entries quantize the selected linears with the same numerics as the text decoder's and the
savers write them (under the checkpoint's own names) as they write a decoder layer. Entries
that only transform weights (smoothing, rotation) do not take part: they act on the text
decoder. A run whose entries select no vision linear skips the stage, and the vision tensors
are written unchanged with the other tensors outside the layers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from msquant.model.adapter_registry import adapter_for
from msquant.model.layers import DecoderLayer
from msquant.model.vision import vision_parts
from msquant.planning.model import ModulePlanner
from msquant.planning.vision_scopes import vision_selections
from msquant.plugin.context import RunContext
from msquant.plugin.processor import Processor
from msquant.report.run_report import LayerTiming

__all__ = ["VISION_STAGE_INDEX", "run_vision_stage", "vision_stage_processors"]

logger = logging.getLogger(__name__)

#: The index of a vision part presented as a layer (it is in no layer list).
VISION_STAGE_INDEX = -1


def vision_stage_processors(processors: Sequence[Processor]) -> list[Processor]:
    """The processors a vision part is presented to: the quantizing entries (module planners)
    and the savers."""
    return [p for p in processors if p.stage == "save" or isinstance(p, ModulePlanner)]


def run_vision_stage(ctx: RunContext, processors: Sequence[Processor]) -> int:
    """Quantize and write the vision linears the entries select, part by part (nothing for a
    text-only model or when no entry selects one).

    :returns: the number of vision parts presented.
    """
    head = adapter_for(ctx.model).output_head(ctx.model)
    head_name = head[0] if head else None
    planners = [
        (index, p)
        for index, p in enumerate(p for p in processors if p.stage == "process")
        if isinstance(p, ModulePlanner)
    ]
    selections = vision_selections(planners, ctx.model, head_name)
    if not selections:
        return 0
    chosen = {name for _, decisions in selections for name in decisions}
    taking_part = vision_stage_processors(processors)
    count = 0
    for name, module in vision_parts(ctx.model, head_name):
        if not any(selected.startswith(f"{name}.") for selected in chosen):
            continue
        started = time.perf_counter()
        stage = DecoderLayer(VISION_STAGE_INDEX, name, module)
        if ctx.streamed is not None:
            ctx.streamed.materialize(module, name)
        ctx.backend.to_device(module)
        for processor in taking_part:
            processor.before_layer(ctx, stage)
        for processor in taking_part:
            current = DecoderLayer(VISION_STAGE_INDEX, name, ctx.model.get_submodule(name))
            processor.after_layer(ctx, current)
        ctx.backend.offload(ctx.model.get_submodule(name))
        ctx.backend.empty_cache()
        seconds = time.perf_counter() - started
        ctx.report.add_layer(LayerTiming(VISION_STAGE_INDEX, name, seconds))
        logger.info("vision part %s quantized without calibration in %.2f s", name, seconds)
        count += 1
    return count
