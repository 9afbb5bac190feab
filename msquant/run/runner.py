"""The layer-wise runner: processors act on one decoder layer at a time.

For each layer in order: move it to the device, call every processor's ``before_layer``, run the
layer over the calibration activations (only when a processor needs calibration; as many passes
as a processor's ``calibration_passes`` asks for, each between ``before_pass`` and ``after_pass``;
a processor that ``rewrites_layer`` gets its passes before the processors after it get theirs,
see :func:`calibration_stages`), call every ``after_layer``, and move the layer back to host
memory. The next layer's inputs are the outputs of the first pass (of the last group of passes
that calibrates; the layer still float), or, when a processor sets ``calibrate_on_quantized``, of
one more forward after ``after_layer`` (the layer as processed). A calibrating processor that
sets ``calibrates_after_previous`` starts a new segment of the layer's processors: the segments
run one after another (``before_layer``, passes, ``after_layer`` each), so it observes the layer as
the processors before it finished it, and the next layer's inputs are the outputs of the first
pass of the last segment that calibrates (:func:`layer_segments`).
Device memory is therefore bounded by one layer plus its calibration activations.

In a streamed run (``ctx.streamed``) the layers' weights are on disk: each layer is read just
before its processors run and returned to the meta device after its ``after_layer`` (its
quantized weights go to ``ctx.spill`` first, for the read-back check of the exports), so host
memory too holds one layer at a time.

With ``checkpoints`` (:mod:`msquant.run.checkpoint`) each finished layer's quantized linears and a
checkpoint are written after it, and a resumed run starts after the checkpoint's last layer. In a
run whose processors transform weights, the checkpoint also holds the probe's hidden states and
(for a model kept in memory) the finished layers' float tensors; the processors' ``setup`` derives
the rest again (quarot's rotated embedding and head).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from msquant.contracts.context import RunContext
from msquant.contracts.processor import Processor, flatten_processors
from msquant.errors import QuantizationError
from msquant.load.streaming import collect_new_objects_only
from msquant.model.layers import DecoderLayer
from msquant.report.run_report import LayerTiming
from msquant.run.capture import (
    DEFAULT_MAX_BATCH_TOKENS,
    CalibrationActivations,
    batch_samples,
    capture_layer_inputs,
)
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.output_head import run_output_head
from msquant.run.probe import TransformProbe
from msquant.run.vision_stage import calibrated_vision_stage, run_vision_stage

__all__ = [
    "batch_token_limit",
    "calibrates_on_quantized",
    "calibration_stages",
    "layer_segments",
    "needs_calibration",
    "needs_probe",
    "run_layer_wise",
]

logger = logging.getLogger(__name__)


def needs_calibration(processors: Sequence[Processor]) -> bool:
    """Whether any processor asks for calibration activations."""
    return any(p.requires_calibration for p in processors)


def needs_probe(processors: Sequence[Processor]) -> bool:
    """Whether a processor (a group's children included) transforms weights, and so proves on
    the probe tokens that it keeps the model's function (:mod:`msquant.run.probe`)."""
    return any(p.transforms_weights for p in flatten_processors(processors))


@torch.no_grad()
def run_layer_wise(
    ctx: RunContext,
    processors: Sequence[Processor],
    samples: Sequence[torch.Tensor] | None,
    progress: bool = True,
    checkpoints: RunCheckpoints | None = None,
    media: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> None:
    """Run ``processors`` over ``ctx.model`` layer by layer.

    :param samples: tokenized calibration samples (``[1, seq]`` input_ids); required when a
        processor needs calibration, ignored otherwise.
    :param progress: show tqdm progress bars on stderr.
    :param checkpoints: write a checkpoint after each layer (:mod:`msquant.run.checkpoint`), and when
        it resumes one, continue after its last finished layer.
    :param media: image calibration of a vision-language model: per sample, its model inputs
        beside the token ids (pixel values, image grid, ...). The decoder's inputs are then
        captured through the vision tower, whose selected linears are calibrated on the same
        forward (:func:`msquant.run.vision_stage.calibrated_vision_stage`); no checkpoints.
    """
    if media is not None and checkpoints is not None:
        raise ValueError("a run calibrated on images writes no checkpoints")
    if checkpoints is not None and checkpoints.finished:  # the export files are complete
        checkpoints.restore_finished(ctx)
        return
    probe = None
    if needs_probe(processors):
        probe = TransformProbe(ctx.model, ctx.layers, ctx.backend, samples)
        if checkpoints is not None:  # the in-memory model's transformed floats are restored
            checkpoints.keeps_floats = ctx.streamed is None
    ctx.probe = probe
    try:
        with collect_new_objects_only():
            _run_layers(ctx, processors, samples, progress, checkpoints, probe, media)
    finally:
        ctx.probe = None


def _run_layers(
    ctx: RunContext,
    processors: Sequence[Processor],
    samples: Sequence[torch.Tensor] | None,
    progress: bool,
    checkpoints: RunCheckpoints | None,
    probe: TransformProbe | None,
    media: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> None:
    """The body of :func:`run_layer_wise` (``ctx.probe`` set)."""
    for processor in processors:
        processor.setup(ctx)
    activations = None
    calibrated_vision: set[str] = set()
    if needs_calibration(processors):
        if not samples:
            raise ValueError("calibration samples are required by the configured processors")
        started = time.perf_counter()
        if ctx.streamed is not None:  # capture runs the first layer once to learn its output type
            ctx.streamed.materialize(ctx.layers[0].module, ctx.layers[0].name)
        batch_tokens = batch_token_limit(processors)
        _check_batches_for_processes(samples, ctx.dist.world_size, batch_tokens)
        vision = (
            nullcontext(calibrated_vision)
            if media is None
            else calibrated_vision_stage(ctx, processors)
        )
        with vision as calibrated_vision:
            activations = capture_layer_inputs(
                ctx.model,
                ctx.layers,
                samples,
                max_batch_tokens=batch_tokens,
                part=(ctx.dist.rank, ctx.dist.world_size),
                media=media,
            )
        ctx.report.capture_seconds = time.perf_counter() - started
        logger.info(
            "captured decoder inputs for %d sample(s), %d token(s) in %.1f s",
            len(samples),
            activations.token_count,
            ctx.report.capture_seconds,
        )
    if probe is not None:
        if ctx.streamed is not None:  # capture runs the first layer once to learn its output type
            ctx.streamed.materialize(ctx.layers[0].module, ctx.layers[0].name)
        probe.capture()
        ctx.report.probe_tokens = probe.tokens
    quantized = calibrates_on_quantized(processors)
    if activations is not None and quantized:
        logger.info("each decoder layer is calibrated on the quantized previous layers' outputs")
    start = 0
    if checkpoints is not None and checkpoints.resuming:
        start = checkpoints.restore(ctx, processors, activations)
    for layer in tqdm(
        ctx.layers[start:],
        desc="layers",
        unit="layer",
        disable=not progress,
        initial=start,
        total=len(ctx.layers),
    ):
        started = time.perf_counter()
        if ctx.streamed is not None:
            ctx.streamed.materialize(layer.module, layer.name)
        ctx.backend.to_device(layer.module)
        if probe is not None:
            probe.enter(layer)
        outputs = None
        segments = layer_segments(processors)
        last = max((i for i, s in enumerate(segments) if needs_calibration(s)), default=-1)
        for number, segment in enumerate(segments):
            for processor in segment:
                processor.before_layer(ctx, layer)
            if activations is not None and needs_calibration(segment):
                kept = _calibrate(ctx, segment, layer, activations, quantized or number != last)
                outputs = kept if number == last else outputs
            for processor in segment:
                processor.after_layer(ctx, layer)
        if activations is not None:
            if outputs is None:  # calibrate_on_quantized: the processed layer's outputs
                outputs = activations.run(layer, ctx.backend)
            assert outputs is not None
            activations.commit(layer, outputs)
        check_seconds = None if probe is None else probe.leave(layer, ctx.report)
        ctx.backend.offload(layer.module)
        if checkpoints is not None:
            checkpoints.keep_layer(layer)
        if ctx.streamed is not None:
            _release(ctx, layer)
        ctx.backend.empty_cache()
        seconds = time.perf_counter() - started
        ctx.report.add_layer(LayerTiming(layer.index, layer.name, seconds, check_seconds))
        if checkpoints is not None:
            checkpoints.commit_layer(ctx, processors, layer, activations)
        logger.debug("layer %s done in %.2f s", layer.name, seconds)
    # a vision-language model's vision linears an entry selects, not calibrated on images above
    run_vision_stage(ctx, processors, calibrated_vision)
    # lm_head, only when a processor asked for it (linear_quant lm_head: true)
    run_output_head(ctx, processors, activations.hidden if activations is not None else None)
    for processor in processors:
        processor.finalize(ctx)
    if checkpoints is not None:
        checkpoints.commit_finished(ctx)


def batch_token_limit(processors: Sequence[Processor]) -> int:
    """Tokens per calibration batch: 0 (one sample at a time, in order) when a calibrating
    processor clears ``batch_calibration``, else :data:`DEFAULT_MAX_BATCH_TOKENS`."""
    one_by_one = any(p.requires_calibration and not p.batch_calibration for p in processors)
    return 0 if one_by_one else DEFAULT_MAX_BATCH_TOKENS


def calibrates_on_quantized(processors: Sequence[Processor]) -> bool:
    """Whether a calibrating processor asks for layers calibrated on quantized outputs."""
    return any(p.requires_calibration and p.calibrate_on_quantized for p in processors)


def _calibrate(
    ctx: RunContext,
    processors: Sequence[Processor],
    layer: DecoderLayer,
    activations: CalibrationActivations,
    quantized: bool,
) -> list[torch.Tensor] | None:
    """Push the calibration set through ``layer`` as many times as a processor asks for.

    :param quantized: the next layer's inputs come from a forward after ``after_layer``; else
        they are the outputs of the first pass (run before any ``after_pass`` of its group could
        change the layer) of the last group of :func:`calibration_stages` that calibrates,
        returned here: with a processor that rewrites the layer before, the rewritten layer's
        outputs as the later processors' forwards compute them (msModelSlim feeds the next layer
        the outputs of the last calibrating processor's forward).
    """
    stages = calibration_stages(processors)
    if len(stages) > 1:  # a group gathering nothing costs no forward
        stages = [stage for stage in stages if needs_calibration(stage)]
    outputs = None
    for number, stage in enumerate(stages):
        keep = number == len(stages) - 1 and not quantized
        passes = max(processor.calibration_passes(layer) for processor in stage)
        if passes > 1:
            logger.debug("%s: %d calibration passes", layer.name, passes)
        for index in range(passes):
            for processor in stage:
                processor.before_pass(ctx, layer, index)
            kept = activations.run(layer, ctx.backend, keep_outputs=keep and index == 0)
            outputs = kept if kept is not None else outputs
            for processor in stage:
                processor.after_pass(ctx, layer, index)
    return outputs


def layer_segments(processors: Sequence[Processor]) -> list[list[Processor]]:
    """The processors split, in ``spec.process`` order, before each calibrating processor that
    sets ``calibrates_after_previous`` (not the first): each segment runs its ``before_layer``,
    passes and ``after_layer`` before the next one starts, so that processor observes the layer
    as the processors before it finished it (msModelSlim's order). Without such a processor
    there is one segment, every processor."""
    segments: list[list[Processor]] = [[]]
    for processor in processors:
        if processor.requires_calibration and processor.calibrates_after_previous and segments[-1]:
            segments.append([])
        segments[-1].append(processor)
    return segments


def calibration_stages(processors: Sequence[Processor]) -> list[list[Processor]]:
    """The processors grouped by the calibration passes they share, in ``spec.process`` order.

    A calibrating processor that sets ``rewrites_layer`` (it changes the layer's weights at the
    end of its passes, e.g. a smoothing processor folding its scales) closes its group: the
    processors after it get passes of their own, over the rewritten layer, so that what they
    gather (activation ranges, Hessians) sees the layer as it will be quantized. Without such a
    processor there is one group, every processor, as before.
    """
    stages: list[list[Processor]] = [[]]
    for processor in processors:
        stages[-1].append(processor)
        if processor.requires_calibration and processor.rewrites_layer:
            stages.append([])
    return [stage for stage in stages if stage]


def _check_batches_for_processes(
    samples: Sequence[torch.Tensor], world_size: int, batch_tokens: int
) -> None:
    """Each process of a ``dp_layer_wise`` group needs at least one calibration batch."""
    batches = len(batch_samples(samples, batch_tokens))
    if batches < world_size:
        raise QuantizationError(
            f"dp_layer_wise: {world_size} processes but only {batches} calibration batch(es) "
            f"(samples of equal length are stacked up to {DEFAULT_MAX_BATCH_TOKENS} tokens); use "
            "at most that many processes, or more calibration samples"
        )


def _release(ctx: RunContext, layer: DecoderLayer) -> None:
    """Keep the layer's quantized weights in the spill, then free all of its tensors."""
    assert ctx.streamed is not None
    if ctx.spill is not None:
        ctx.spill.save(layer.name, layer.module, layer.name)
    ctx.streamed.release(layer.module)
