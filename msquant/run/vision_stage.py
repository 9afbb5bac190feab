"""The vision stage of a run: a vision-language model's vision tower and projector linears
quantized, when a ``spec.process`` entry selects them.

A run calibrated on images (:mod:`msquant.load.image_calibration`) calibrates them on the images:
:func:`calibrated_vision_stage` presents each selected vision part to the quantizing entries and
the savers as one more layer, with ``before_layer`` and the first calibration pass's
``before_pass`` before the capture of the decoder's inputs (which runs the whole multimodal body
one image sample after the other, the vision tower included: the entries' hooks see its linears'
inputs, sample by sample, and W8A8's online range calibration computes their outputs from the
inputs fake-quantized with the range seen so far, as msModelSlim's layer-wise run of the vision
tower does), then ``after_pass`` and ``after_layer`` once the capture is done, before the first
decoder layer. The vision parts stay in host memory there, as the capture's embeddings do.

A run calibrated on text (:mod:`msquant.model.vision`) gets no calibration data to the vision
tower; the plan admits an entry selecting linears there only when their scheme is
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from msquant.contracts.context import RunContext
from msquant.contracts.processor import Processor
from msquant.model.adapter_registry import adapter_for
from msquant.model.layers import DecoderLayer
from msquant.model.vision import vision_parts
from msquant.planning.model import ModulePlanner
from msquant.planning.vision_scopes import vision_selections
from msquant.report.run_report import LayerTiming

__all__ = [
    "VISION_STAGE_INDEX",
    "calibrated_vision_stage",
    "run_vision_stage",
    "vision_stage_processors",
]

logger = logging.getLogger(__name__)

#: The index of a vision part presented as a layer (it is in no layer list).
VISION_STAGE_INDEX = -1


def vision_stage_processors(processors: Sequence[Processor]) -> list[Processor]:
    """The processors a vision part is presented to: the quantizing entries (module planners)
    and the savers."""
    return [p for p in processors if p.stage == "save" or isinstance(p, ModulePlanner)]


def _selected_parts(
    ctx: RunContext, processors: Sequence[Processor]
) -> list[tuple[str, nn.Module]]:
    """The vision parts holding a linear an entry selects (none for a text-only model)."""
    head = adapter_for(ctx.model).output_head(ctx.model)
    head_name = head[0] if head else None
    planners = [
        (index, p)
        for index, p in enumerate(p for p in processors if p.stage == "process")
        if isinstance(p, ModulePlanner)
    ]
    selections = vision_selections(planners, ctx.model, head_name)
    if not selections:
        return []
    chosen = {name for _, decisions in selections for name in decisions}
    return [
        (name, module)
        for name, module in vision_parts(ctx.model, head_name)
        if any(selected.startswith(f"{name}.") for selected in chosen)
    ]


@contextmanager
def calibrated_vision_stage(ctx: RunContext, processors: Sequence[Processor]) -> Iterator[set[str]]:
    """The selected vision parts calibrated on what runs inside the ``with`` block (the capture
    of the decoder's inputs on image samples), then quantized and written; yields the names of
    the parts, which :func:`run_vision_stage` then skips."""
    parts = _selected_parts(ctx, processors)
    taking_part = vision_stage_processors(processors)
    done = {name for name, _ in parts}
    started = time.perf_counter()
    for name, module in parts:
        if ctx.streamed is not None:
            ctx.streamed.materialize(module, name)
        stage = DecoderLayer(VISION_STAGE_INDEX, name, module)
        for processor in taking_part:
            processor.before_layer(ctx, stage)
        for processor in taking_part:
            processor.before_pass(ctx, stage, 0)
    yield done
    for name, _ in parts:
        current = DecoderLayer(VISION_STAGE_INDEX, name, ctx.model.get_submodule(name))
        for processor in taking_part:
            processor.after_pass(ctx, current, 0)
        for processor in taking_part:
            processor.after_layer(ctx, current)
        seconds = time.perf_counter() - started
        ctx.report.add_layer(LayerTiming(VISION_STAGE_INDEX, name, seconds))
        logger.info("vision part %s calibrated on the images and quantized", name)
        started = time.perf_counter()


def run_vision_stage(
    ctx: RunContext, processors: Sequence[Processor], done: set[str] | frozenset[str] = frozenset()
) -> int:
    """Quantize and write the vision linears the entries select, part by part (nothing for a
    text-only model or when no entry selects one), without calibration.

    :param done: the parts :func:`calibrated_vision_stage` quantized already.
    :returns: the number of vision parts presented.
    """
    taking_part = vision_stage_processors(processors)
    count = 0
    for name, module in _selected_parts(ctx, processors):
        if name in done:
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
