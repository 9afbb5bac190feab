"""The output head stage of a run: after the last decoder layer and before ``finalize``, when a
processor asks for it (:class:`~msquant.plugin.OutputHeadUser`).

Every processor gets ``before_layer`` / ``after_layer`` (and ``before_pass`` / ``after_pass``
around its single calibration pass) with an :class:`~msquant.plugin.model.OutputHeadStage`
(:mod:`msquant.model.head`).

Calibration: the head's input is the model's final norm applied to the last decoder layer's
outputs, which the runner's :class:`~msquant.run.capture.CalibrationActivations` already hold
after the last ``advance``. :func:`run_head_calibration` pushes ``head(norm(hidden))`` through the
head sample by sample and in token chunks, discarding the ``[tokens, vocab]`` logits at once: only
the forward hooks of the processors (e.g. a GPTQ Hessian of the ``hidden``-wide inputs) keep
anything. This holds for Llama, Qwen2/3, Mistral and most decoder-only models (the body's last
step is its final norm); a model that transforms the hidden states further before the head by
more than a constant factor (which GPTQ is invariant to) would calibrate the head on the wrong
inputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from msquant.backends.base import Backend
from msquant.contracts.context import RunContext
from msquant.contracts.processor import OutputHeadUser, Processor
from msquant.model.adapter_registry import adapter_for
from msquant.report.run_report import LayerTiming

__all__ = ["LOGITS_PER_CHUNK", "head_requested", "run_head_calibration", "run_output_head"]

logger = logging.getLogger(__name__)

#: Logit elements one head forward may produce (256 MiB in float32): the token chunk size is this
#: divided by the vocabulary size.
LOGITS_PER_CHUNK = 2**26


def head_requested(processors: Sequence[Processor], ctx: RunContext) -> bool:
    """Whether any processor asks for the head stage (default runs never run it)."""
    return any(isinstance(p, OutputHeadUser) and p.uses_output_head(ctx) for p in processors)


@torch.no_grad()
def run_head_calibration(
    norm: nn.Module | None,
    head: nn.Module,
    hidden: Sequence[torch.Tensor],
    backend: Backend,
    logits_per_chunk: int = LOGITS_PER_CHUNK,
) -> int:
    """Run ``head(norm(h))`` for every sample ``h`` (``[..., hidden]``, on the host), in token
    chunks of at most ``logits_per_chunk / out_features`` rows; the logits are dropped at once.

    Processors see the head's inputs through their forward hooks.

    :param norm: the final norm (on the device), or None when the head reads ``h`` directly.
    :param head: the head (on the device).
    :returns: the number of tokens pushed through the head.
    """
    out_features = int(getattr(head, "out_features", 0) or 1)
    rows = max(1, logits_per_chunk // out_features)
    tokens = 0
    for sample in hidden:
        x = backend.tensor_to_device(sample)
        if norm is not None:
            x = norm(x)
        flat = x.reshape(-1, x.shape[-1])
        for start in range(0, int(flat.shape[0]), rows):
            head(flat[start : start + rows])
        tokens += int(flat.shape[0])
    return tokens


def run_output_head(
    ctx: RunContext,
    processors: Sequence[Processor],
    hidden: Sequence[torch.Tensor] | None,
) -> None:
    """The head stage, when a processor asks for it: ``before_layer``, the calibration forward
    over ``hidden`` (the last decoder layer's outputs per sample; None without calibration),
    ``after_layer`` (each processor receives the head as the model holds it at that moment, so
    savers see the quantized module), then the head goes back to host memory.

    Without a findable final norm the calibration forward is skipped with a warning
    (``linear_quant`` refuses a GPTQ head on such models before weights load).

    :raises RuntimeError: when a processor asks for the head but the model has none.
    """
    if not head_requested(processors, ctx):
        return
    started = time.perf_counter()
    adapter = adapter_for(ctx.model)
    stage = adapter.output_head_stage(ctx.model, ctx.layers)
    if stage is None:
        raise RuntimeError(f"{type(ctx.model).__name__} has no output head to quantize")
    norm = adapter.final_norm(ctx.model, ctx.layers) if hidden is not None else None
    if hidden is not None and norm is None:
        logger.warning(
            "cannot find the final norm of %s: %s gets no calibration data",
            type(ctx.model).__name__,
            stage.name,
        )
        hidden = None
    if norm is not None:
        ctx.backend.to_device(norm)
    ctx.backend.to_device(stage.module)
    for processor in processors:
        processor.before_layer(ctx, stage)
    if hidden is not None:  # one calibration pass: the head has no experts to split
        for processor in processors:
            processor.before_pass(ctx, stage, 0)
        tokens = run_head_calibration(norm, stage.module, hidden, ctx.backend)
        logger.debug("%s: %d calibration token(s) through the head", stage.name, tokens)
        for processor in processors:
            processor.after_pass(ctx, stage, 0)
    for processor in processors:
        current = adapter.output_head_stage(ctx.model, ctx.layers)
        assert current is not None
        processor.after_layer(ctx, current)
    final = adapter.output_head_stage(ctx.model, ctx.layers)
    for module in (final.module if final else None, norm):
        if module is not None:
            ctx.backend.offload(module)
    ctx.backend.empty_cache()
    seconds = time.perf_counter() - started
    ctx.report.add_layer(LayerTiming(stage.index, stage.name, seconds))
    logger.debug("output head %s done in %.2f s", stage.name, seconds)
