"""Capture what each decoder layer receives, then run the stack one layer at a time.

Capture swaps every decoder layer for a recorder that stores the layer's call arguments and passes
the hidden states through unchanged, and runs the model body once per calibration batch. That
costs the embeddings and the per-layer inputs the model computes itself (attention masks, which
differ between full and sliding-window layers, rotary embeddings, positions), never a layer's work.
The hidden states entering layer 0 are then pushed through the real layers one at a time.

Samples of equal length are stacked into batches of up to ``max_batch_tokens`` tokens (no padding,
so no token is added and every Hessian sees exactly the calibration tokens): one ``[8, 512]``
forward costs a quarter of eight ``[1, 512]`` forwards on a CPU, since small matrix products and
per-call overhead dominate there. Batches keep the samples' order within each length.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from msquant.backends.base import Backend
from msquant.errors import ModelLoadError
from msquant.model.layers import DecoderLayer, layer_list_name, parent_module

__all__ = [
    "DEFAULT_MAX_BATCH_TOKENS",
    "LayerCall",
    "CalibrationActivations",
    "batch_samples",
    "capture_layer_inputs",
    "first_layer_input",
    "tree_to_device",
]

# Tokens per calibration batch: 8 samples of 512 tokens; the largest intermediate activation of a
# 70B-class layer (28672 wide) is then about 470 MB in float32.
DEFAULT_MAX_BATCH_TOKENS = 4096


@dataclass
class LayerCall:
    """The arguments of one decoder layer call, without the hidden states."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class CalibrationActivations:
    """Per-batch hidden states entering the next layer, plus each layer's other call arguments."""

    hidden: list[torch.Tensor]  # [batch] of [samples, seq, hidden]
    calls: list[list[LayerCall]]  # [batch][layer]
    tuple_output: bool = False
    next_layer: int = 0
    token_count: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_count = sum(int(h.shape[0] * h.shape[1]) for h in self.hidden)

    @torch.no_grad()
    def run(
        self, layer: DecoderLayer, backend: Backend, keep_outputs: bool = True
    ) -> list[torch.Tensor] | None:
        """Run ``layer`` (already on the backend's device) over every batch of the current inputs.

        The inputs are left in place (a layer may get several calibration passes); the outputs,
        when kept, go to :meth:`commit` to become the next layer's inputs.

        :param keep_outputs: False for a pass whose outputs are not needed (only its forward
            hooks matter): they are dropped batch by batch.
        :returns: the outputs per batch (on the inputs' device), or None.
        """
        if layer.index != self.next_layer:
            raise RuntimeError(
                f"layers must be run in order: expected {self.next_layer}, got {layer.index}"
            )
        outputs = []
        for hidden, calls in zip(self.hidden, self.calls, strict=True):
            call = calls[layer.index]
            result = layer.module(
                backend.tensor_to_device(hidden),
                *tree_to_device(call.args, backend),
                **tree_to_device(call.kwargs, backend),
            )
            if keep_outputs:
                out = result[0] if isinstance(result, tuple) else result
                outputs.append(out.to(hidden.device))
            del result
        return outputs if keep_outputs else None

    def commit(self, layer: DecoderLayer, outputs: list[torch.Tensor]) -> None:
        """Make ``outputs`` (from :meth:`run` over ``layer``) the inputs of the next layer."""
        if layer.index != self.next_layer or len(outputs) != len(self.hidden):
            raise RuntimeError(
                f"outputs of layer {layer.index} ({len(outputs)} batches) cannot follow the inputs "
                f"of layer {self.next_layer} ({len(self.hidden)} batches)"
            )
        self.hidden = outputs
        self.next_layer += 1

    def advance(self, layer: DecoderLayer, backend: Backend) -> None:
        """Run ``layer`` over every batch and make its outputs the next layer's inputs."""
        outputs = self.run(layer, backend, keep_outputs=True)
        assert outputs is not None
        self.commit(layer, outputs)


def tree_to_device(obj: Any, backend: Backend) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) on ``backend``'s device."""
    if isinstance(obj, torch.Tensor):
        return backend.tensor_to_device(obj)
    if isinstance(obj, tuple):
        return tuple(tree_to_device(o, backend) for o in obj)
    if isinstance(obj, list):
        return [tree_to_device(o, backend) for o in obj]
    if isinstance(obj, dict):
        return {k: tree_to_device(v, backend) for k, v in obj.items()}
    return obj


class _LayerStandIn(nn.Module):
    """Stands in for a decoder layer in the model's layer list while the model body runs."""

    def __init__(self, real: nn.Module) -> None:
        super().__init__()
        self.real = [real]  # a list keeps the real layer out of this module's children

    def __getattr__(self, name: str) -> Any:
        """Attributes the model's forward reads off its layers (transformers 4's Qwen3 reads
        ``attention_type``) come from the real layer."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("real")
            if not real:
                raise
            return getattr(real[0], name)


class _Recorder(_LayerStandIn):
    """Stands in for a decoder layer during capture: records its inputs, returns them unchanged."""

    def __init__(self, index: int, real: nn.Module, session: _CaptureSession) -> None:
        super().__init__(real)
        self.index = index
        self.session = session

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        session = self.session
        if self.index == 0:
            session.first_hidden = hidden_states
            if session.tuple_output is None:  # learn the layer's return convention once
                output = self.real[0](hidden_states, *args, **kwargs)
                session.tuple_output = isinstance(output, tuple)
                if session.tuple_output:
                    session.extra_outputs = _extra_outputs(self.real[0], output)
        session.calls.append(LayerCall(args, dict(kwargs)))
        session.order.append(self.index)
        if not session.tuple_output:
            return hidden_states
        return (hidden_states, *([None] * session.extra_outputs))


def _extra_outputs(layer: nn.Module, output: tuple[Any, ...]) -> int:
    """How many outputs a decoder layer returns beside its hidden states (all None: attention
    weights not asked for); a layer handing something else to the next one is refused."""
    extra = output[1:]
    if any(value is not None for value in extra):
        kinds = ", ".join(type(value).__name__ for value in extra)
        raise ModelLoadError(
            f"{type(layer).__name__} returns more than its hidden states ({kinds} beside them), "
            "which the model passes on to the next layers: msquant runs the decoder layers one "
            "at a time from the hidden states and the arguments each received, so an "
            "architecture whose layers hand other state to each other is not supported"
        )
    return len(extra)


@dataclass
class _CaptureSession:
    calls: list[LayerCall] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    first_hidden: torch.Tensor | None = None
    tuple_output: bool | None = None
    #: the None outputs a tuple-returning layer gives beside its hidden states
    extra_outputs: int = 0


def batch_samples(
    samples: Sequence[torch.Tensor], max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
) -> list[torch.Tensor]:
    """Stack ``[1, seq]`` samples of equal length into ``[n, seq]`` batches of at most
    ``max_batch_tokens`` tokens (a longer sample is a batch of its own).

    Batches come in the order of their first sample, and samples keep their order within a batch,
    so the result depends only on the samples.
    """
    groups: dict[int, list[list[torch.Tensor]]] = {}
    order: list[list[torch.Tensor]] = []
    for sample in samples:
        if sample.dim() != 2 or sample.shape[0] != 1:
            raise ValueError(
                f"calibration samples must be [1, seq] tensors, got {tuple(sample.shape)}"
            )
        length = int(sample.shape[1])
        open_batches = groups.setdefault(length, [])
        if not open_batches or (len(open_batches[-1]) + 1) * length > max(max_batch_tokens, length):
            open_batches.append([])
            order.append(open_batches[-1])
        open_batches[-1].append(sample)
    return [torch.cat(batch, dim=0) for batch in order]


@torch.no_grad()
def capture_layer_inputs(
    model: nn.Module,
    layers: list[DecoderLayer],
    samples: Sequence[torch.Tensor],
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    part: tuple[int, int] = (0, 1),
) -> CalibrationActivations:
    """Record the inputs of every decoder layer for the calibration samples (``[1, seq]``
    input_ids tensors), batched by :func:`batch_samples`.

    :param part: ``(rank, world_size)``: keep batches ``rank``, ``rank + world_size``, ... only
        (a process of a ``dp_layer_wise`` group calibrates on its share).

    The model body (the module owning the layer list) runs with ``use_cache=False``; the layer list
    is restored afterwards even if a forward fails.
    """
    body = parent_module(model, layers)
    _check_body(body)
    layer_list = model.get_submodule(layer_list_name(layers))
    assert isinstance(layer_list, nn.ModuleList)
    session = _CaptureSession()
    originals = list(layer_list)
    hidden: list[torch.Tensor] = []
    calls: list[list[LayerCall]] = []
    try:
        for i, real in enumerate(originals):
            layer_list[i] = _Recorder(i, real, session)
        rank, world_size = part
        for input_ids in batch_samples(samples, max_batch_tokens)[rank::world_size]:
            session.calls = []
            session.order = []
            session.first_hidden = None
            body(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
            if session.order != list(range(len(originals))) or session.first_hidden is None:
                raise ModelLoadError(_order_message(body, session.order, len(originals)))
            hidden.append(session.first_hidden.detach())
            calls.append(session.calls)
    finally:
        for i, real in enumerate(originals):
            layer_list[i] = real
    return CalibrationActivations(hidden, calls, tuple_output=bool(session.tuple_output))


def _check_body(body: nn.Module) -> None:
    """Refuse a layer list whose owner cannot be run from token ids (msquant runs it with
    ``input_ids`` to record what each decoder layer receives)."""
    try:
        parameters = inspect.signature(body.forward).parameters
    except (TypeError, ValueError):
        return
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    required = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and name != "input_ids"
    ]
    if required or ("input_ids" not in parameters and not takes_any):
        raise ModelLoadError(
            f"{type(body).__name__}, the module holding the decoder layers, does not take "
            "input_ids: msquant records each decoder layer's inputs by running that module on "
            "the calibration tokens, so this architecture (a layer stack driven by another "
            "module) is not supported"
        )


def _order_message(body: nn.Module, order: list[int], count: int) -> str:
    shown = ", ".join(map(str, order[:12])) + (", ..." if len(order) > 12 else "")
    return (
        f"{type(body).__name__} called its decoder layers in the order [{shown}] instead of once "
        f"each, in order 0..{count - 1}: msquant processes a model one decoder layer at a time on "
        "the inputs recorded for it, which needs a model body that calls each layer once, in "
        "order (layers run several times or skipped, as in recurrent-depth models, are not "
        "supported)"
    )


class _FirstLayerReached(Exception):
    """Stops the model body once the first decoder layer's input is recorded."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("first decoder layer reached")
        self.hidden = hidden


class _StopAtFirstLayer(_LayerStandIn):
    """Stands in for the first decoder layer: raises with its input (the layer never runs, so
    its weights need not be loaded)."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise _FirstLayerReached(hidden_states.detach())


@torch.no_grad()
def first_layer_input(
    model: nn.Module, layers: list[DecoderLayer], input_ids: torch.Tensor
) -> torch.Tensor:
    """The hidden states the model body feeds its first decoder layer for ``input_ids``
    (``[batch, seq]``): the embeddings and whatever the model applies to them first. No decoder
    layer runs.

    :raises RuntimeError: when the body never calls its first layer.
    """
    body = parent_module(model, layers)
    _check_body(body)
    layer_list = model.get_submodule(layer_list_name(layers))
    assert isinstance(layer_list, nn.ModuleList)
    real = layer_list[0]
    layer_list[0] = _StopAtFirstLayer(real)
    try:
        body(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    except _FirstLayerReached as reached:
        return reached.hidden
    finally:
        layer_list[0] = real
    raise RuntimeError(f"{type(body).__name__} did not call its first decoder layer")
