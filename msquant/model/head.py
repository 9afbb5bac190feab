"""The output head (``lm_head``) as one more stage after the decoder layers.

Quantizing the head is opt-in (``linear_quant``'s ``lm_head: true``). When a processor asks for it
(:class:`OutputHeadUser`), :func:`run_output_head` runs after the last decoder layer and before
``finalize``: every processor gets ``before_layer`` / ``after_layer`` (and ``before_pass`` /
``after_pass`` around its single calibration pass) with an :class:`OutputHeadStage`, a
:class:`~msquant.DecoderLayer` whose ``named_linears()`` yields the head itself under its own
name (``lm_head``), so quantizers and savers treat it like any layer.

Calibration: the head's input is the model's final norm applied to the last decoder layer's
outputs, which the runner's :class:`~msquant.model.capture.CalibrationActivations` already hold
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from msquant.context import DecoderLayer, RunContext
from msquant.model.layers import layer_list_name, parent_module
from msquant.report import LayerTiming

if TYPE_CHECKING:
    from msquant.backends.base import Backend
    from msquant.processor import Processor

__all__ = [
    "FINAL_NORM_NAMES",
    "LOGITS_PER_CHUNK",
    "OutputHeadStage",
    "OutputHeadUser",
    "find_output_head",
    "head_is_tied",
    "tied_head_message",
    "find_final_norm",
    "output_head_stage",
    "head_requested",
    "run_head_calibration",
    "run_output_head",
]

logger = logging.getLogger(__name__)

#: Names of the final norm inside the decoder body, tried first (Llama/Qwen/Mistral ``norm``,
#: GPT-2/Falcon ``ln_f``, GPT-NeoX/OPT ``final_layer_norm``, Phi ``final_layernorm``).
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")
#: Logit elements one head forward may produce (256 MiB in float32): the token chunk size is this
#: divided by the vocabulary size.
LOGITS_PER_CHUNK = 2**26


@dataclass(frozen=True)
class OutputHeadStage(DecoderLayer):
    """The output head presented as a stage: ``name`` is the head's module name (``lm_head``),
    ``module`` the head itself, ``index`` the number of decoder layers (it runs after them).

    Savers write ``module.state_dict(prefix=name + ".")`` and ``module.named_modules(prefix=name)``
    exactly as for a decoder layer; ``isinstance(layer, OutputHeadStage)`` tells the head apart.
    """

    def named_linears(self) -> list[tuple[str, nn.Linear]]:
        """``[(name, head)]`` while the head is a float ``nn.Linear``, else ``[]``."""
        return [(self.name, self.module)] if isinstance(self.module, nn.Linear) else []


@runtime_checkable
class OutputHeadUser(Protocol):
    """A processor that may need the output head stage (e.g. ``linear_quant`` with ``lm_head``)."""

    def uses_output_head(self, ctx: RunContext) -> bool:
        """Whether the runner must run the head stage for this processor in this run."""
        ...


def find_output_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(module name, module)`` of the model's output head (``get_output_embeddings()``), or
    None when the model has none."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Module):
        return None
    for name, module in model.named_modules():
        if module is head and name:
            return name, module
    return None


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def head_is_tied(model: nn.Module) -> bool:
    """Whether the output head shares its weight with the input embeddings: the config says so
    (``tie_word_embeddings``, also under ``text_config``) or the two are one tensor."""
    config = _config(model)
    text = getattr(config, "text_config", None)
    flag = getattr(config, "tie_word_embeddings", None)
    if flag is None and text is not None:
        flag = getattr(text, "tie_word_embeddings", None)
    if flag:
        return True
    found = find_output_head(model)
    getter = getattr(model, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    head_weight = getattr(found[1], "weight", None) if found else None
    return head_weight is not None and head_weight is getattr(embeddings, "weight", None)


def tied_head_message(model: nn.Module, head_name: str, requested_by: str) -> str:
    """Why a tied head cannot be quantized, naming the model, ``tie_word_embeddings`` and the fix."""
    config = _config(model)
    model_type = str(getattr(config, "model_type", "unknown"))
    where = str(getattr(config, "_name_or_path", "") or "")
    described = f"{type(model).__name__} ({model_type}{', ' + where if where else ''})"
    return (
        f"{requested_by} asks to quantize {head_name}, but {described} ties {head_name} to the "
        "input embeddings (tie_word_embeddings: true, one shared tensor): quantizing the head "
        "would also change the embeddings, and loaders re-tie the head to the float embeddings. "
        "Keep the head in float (lm_head: false), or untie the model first (save it with "
        f"tie_word_embeddings: false and its own {head_name}.weight)"
    )


def find_final_norm(model: nn.Module, layers: Sequence[DecoderLayer]) -> nn.Module | None:
    """The decoder body's final norm (applied to the last layer's output before the head).

    A child of the body named in :data:`FINAL_NORM_NAMES`, else the only child with parameters
    registered after the layer list that is not an embedding; None when neither exists.
    """
    if not layers:
        return None
    body = parent_module(model, list(layers))
    children = dict(body.named_children())
    for name in FINAL_NORM_NAMES:
        if name in children:
            return children[name]
    list_leaf = layer_list_name(list(layers)).rpartition(".")[2]
    names = list(children)
    after = names[names.index(list_leaf) + 1 :] if list_leaf in names else []
    candidates = [
        children[name]
        for name in after
        if not isinstance(children[name], nn.Embedding)
        and any(True for _ in children[name].parameters())
    ]
    return candidates[0] if len(candidates) == 1 else None


def output_head_stage(model: nn.Module, layers: Sequence[DecoderLayer]) -> OutputHeadStage | None:
    """The head stage as the model holds it now (re-resolve it after a processor replaced the
    head), or None when the model has no output head."""
    found = find_output_head(model)
    if found is None:
        return None
    name, module = found
    return OutputHeadStage(len(layers), name, module)


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
    stage = output_head_stage(ctx.model, ctx.layers)
    if stage is None:
        raise RuntimeError(f"{type(ctx.model).__name__} has no output head to quantize")
    norm = find_final_norm(ctx.model, ctx.layers) if hidden is not None else None
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
        current = output_head_stage(ctx.model, ctx.layers)
        assert current is not None
        processor.after_layer(ctx, current)
    final = output_head_stage(ctx.model, ctx.layers)
    for module in (final.module if final else None, norm):
        if module is not None:
            ctx.backend.offload(module)
    ctx.backend.empty_cache()
    seconds = time.perf_counter() - started
    ctx.report.add_layer(LayerTiming(stage.index, stage.name, seconds))
    logger.debug("output head %s done in %.2f s", stage.name, seconds)
