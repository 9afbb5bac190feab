"""The layer-wise runner: processors act on one decoder layer at a time.

For each layer in order: move it to the device, call every processor's ``before_layer``, run the
layer over the calibration activations (only when a processor needs calibration; the outputs become
the next layer's inputs), call every ``after_layer``, and move the layer back to host memory.
Device memory is therefore bounded by one layer plus its calibration activations.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from msquant.context import RunContext
from msquant.model.capture import capture_layer_inputs
from msquant.processor import Processor
from msquant.report import LayerTiming

__all__ = ["needs_calibration", "run_layer_wise"]

logger = logging.getLogger(__name__)


def needs_calibration(processors: Sequence[Processor]) -> bool:
    """Whether any processor asks for calibration activations."""
    return any(p.requires_calibration for p in processors)


@torch.no_grad()
def run_layer_wise(
    ctx: RunContext,
    processors: Sequence[Processor],
    samples: Sequence[torch.Tensor] | None,
    progress: bool = True,
) -> None:
    """Run ``processors`` over ``ctx.model`` layer by layer.

    :param samples: tokenized calibration samples (``[1, seq]`` input_ids); required when a
        processor needs calibration, ignored otherwise.
    :param progress: show tqdm progress bars on stderr.
    """
    for processor in processors:
        processor.setup(ctx)
    activations = None
    if needs_calibration(processors):
        if not samples:
            raise ValueError("calibration samples are required by the configured processors")
        started = time.perf_counter()
        activations = capture_layer_inputs(ctx.model, ctx.layers, samples)
        ctx.report.capture_seconds = time.perf_counter() - started
        logger.info(
            "captured decoder inputs for %d sample(s), %d token(s) in %.1f s",
            len(samples),
            activations.token_count,
            ctx.report.capture_seconds,
        )
    for layer in tqdm(ctx.layers, desc="layers", unit="layer", disable=not progress):
        started = time.perf_counter()
        ctx.backend.to_device(layer.module)
        for processor in processors:
            processor.before_layer(ctx, layer)
        if activations is not None:
            activations.advance(layer, ctx.backend)
        for processor in processors:
            processor.after_layer(ctx, layer)
        ctx.backend.offload(layer.module)
        ctx.backend.empty_cache()
        seconds = time.perf_counter() - started
        ctx.report.add_layer(LayerTiming(layer.index, layer.name, seconds))
        logger.debug("layer %s done in %.2f s", layer.name, seconds)
    for processor in processors:
        processor.finalize(ctx)
