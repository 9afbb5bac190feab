"""Capture what each decoder layer receives, then run the stack one layer at a time.

Capture swaps every decoder layer for a recorder that stores the layer's call arguments and passes
the hidden states through unchanged, and runs the model body once per calibration batch. That
costs the embeddings and the per-layer inputs the model computes itself (attention masks, which
differ between full and sliding-window layers, rotary embeddings, positions), never a layer's work.
The hidden states entering layer 0 are then pushed through the real layers one at a time.

A layer may return more than its hidden states for the model body to hand to a later layer (GLM-5's
decoder layers return the DSA indexer's top-k token indices, which the body passes to the next
layer as ``prev_topk_indices``). Where the first layer returns something beside its hidden states,
the recorders return a :class:`HandedOn` marker there; the argument of a later call the body puts
it into is recorded (:attr:`LayerCall.handed`), and the layer-wise run puts in what that layer
returned in the same forward whose hidden states it commits to the next layer. What the body does
otherwise with such an output (computes with it, drops it, nests it) is refused.

A vision-language model calibrated on images (``media``: per sample the processor's pixel values,
image grid, attention mask beside the token ids) is captured one sample at a time through the
module that runs its vision tower, merges the image features into the text embeddings and runs
the text decoder (:func:`msquant.model.vision.multimodal_body_name`), so layer 0 receives the
merged embeddings and every layer the multimodal positions (Qwen3-VL's M-RoPE). What the text
decoder's body does to the hidden states between two layers on image inputs (Qwen3-VL's
deepstack features added after the first layers, :data:`msquant.model.vision.BETWEEN_LAYERS`)
is recorded call by call with its arguments, and made again on each layer's outputs when they
become the next layer's inputs (:meth:`CalibrationActivations.commit`).

Samples of equal length are stacked into batches of up to ``max_batch_tokens`` tokens (no padding,
so no token is added and every Hessian sees exactly the calibration tokens): one ``[8, 512]``
forward costs a quarter of eight ``[1, 512]`` forwards on a CPU, since small matrix products and
per-call overhead dominate there. Batches keep the samples' order within each length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from msquant.backends.base import Backend
from msquant.errors import ModelLoadError
from msquant.model.layers import DecoderLayer, layer_list_name, parent_module
from msquant.model.vision import between_layers_method, multimodal_body_name

__all__ = [
    "BetweenLayers",
    "DEFAULT_MAX_BATCH_TOKENS",
    "HandedOn",
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
    """The arguments of one decoder layer call, without the hidden states.

    ``handed`` names the arguments the model body filled with what an earlier layer returned
    beside its hidden states (:class:`HandedOn`): argument position (``int``, into ``args``) or
    keyword (``str``) -> (that layer's index, the position in its output tuple). Those arguments
    hold None here; the layer-wise run puts in what the earlier layer returned in the run.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    handed: dict[int | str, tuple[int, int]] = field(default_factory=dict)


#: What the model body did to the hidden states after one layer, per call: the bound method and
#: its arguments beside the hidden states.
BetweenLayers = list[tuple[Callable[..., torch.Tensor], tuple[Any, ...], dict[str, Any]]]


@dataclass
class CalibrationActivations:
    """Per-batch hidden states entering the next layer, plus each layer's other call arguments."""

    hidden: list[torch.Tensor]  # [batch] of [samples, seq, hidden]
    calls: list[list[LayerCall]]  # [batch][layer]
    tuple_output: bool = False
    next_layer: int = 0
    token_count: int = field(init=False)
    #: (layer, output position) -> per batch, what that layer returned there in the forward whose
    #: hidden states were committed, kept while a later layer's call takes it (see ``handed``)
    state: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    #: what the last kept :meth:`run` returned beside the hidden states (``id`` of its outputs)
    _pending: tuple[int, dict[tuple[int, int], list[Any]]] | None = field(default=None, repr=False)
    #: per batch, per layer: what the model body applied to that layer's outputs before the
    #: next layer took them (image inputs; empty for text)
    between: list[dict[int, BetweenLayers]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_count = sum(int(h.shape[0] * h.shape[1]) for h in self.hidden)

    @property
    def hands_state_on(self) -> bool:
        """Whether a layer's call takes something an earlier layer returned (GLM-5's indexer)."""
        return any(call.handed for calls in self.calls for call in calls)

    def arguments(self, batch: int, layer: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword arguments (beside the hidden states) of ``layer``'s call on
        batch ``batch``, with what earlier layers handed on put in (:class:`LayerCall`)."""
        call = self.calls[batch][layer]
        if not call.handed:
            return call.args, call.kwargs
        args, kwargs = list(call.args), dict(call.kwargs)
        for slot, source in call.handed.items():
            if source not in self.state:
                raise RuntimeError(
                    f"layer {layer} takes what layer {source[0]} returned at position "
                    f"{source[1]}, which the run has not kept"
                )
            value = self.state[source][batch]
            if isinstance(slot, int):
                args[slot] = value
            else:
                kwargs[slot] = value
        return tuple(args), kwargs

    def takes_state_from_before(self, layer: int) -> bool:
        """Whether a call of ``layer`` or a later layer takes what a layer before ``layer``
        returned (a run resumed at ``layer`` would need it)."""
        return any(
            source[0] < layer
            for call in (self.calls[0][layer:] if self.calls else [])
            for source in call.handed.values()
        )

    def _handed_from(self, layer: int) -> list[int]:
        """The output positions of ``layer`` that a later layer's call takes."""
        positions = {
            source[1]
            for call in (self.calls[0] if self.calls else [])
            for source in call.handed.values()
            if source[0] == layer
        }
        return sorted(positions)

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
        handed = self._handed_from(layer.index) if keep_outputs else []
        kept: dict[tuple[int, int], list[Any]] = {(layer.index, p): [] for p in handed}
        for batch, hidden in enumerate(self.hidden):
            args, kwargs = self.arguments(batch, layer.index)
            result = layer.module(
                backend.tensor_to_device(hidden),
                *tree_to_device(args, backend),
                **tree_to_device(kwargs, backend),
            )
            if keep_outputs:
                out = result[0] if isinstance(result, tuple) else result
                outputs.append(out.to(hidden.device))
                for position in handed:
                    kept[(layer.index, position)].append(_to_host(result[position], hidden.device))
            del result
        if not keep_outputs:
            return None
        self._pending = (id(outputs), kept)
        return outputs

    def commit(self, layer: DecoderLayer, outputs: list[torch.Tensor]) -> None:
        """Make ``outputs`` (from :meth:`run` over ``layer``) the inputs of the next layer, and
        what that same forward returned beside them the state later layers take."""
        if layer.index != self.next_layer or len(outputs) != len(self.hidden):
            raise RuntimeError(
                f"outputs of layer {layer.index} ({len(outputs)} batches) cannot follow the inputs "
                f"of layer {self.next_layer} ({len(self.hidden)} batches)"
            )
        if self._handed_from(layer.index):
            if self._pending is None or self._pending[0] != id(outputs):
                raise RuntimeError(
                    f"the outputs committed for layer {layer.index} are not those of its last "
                    "kept forward, whose handed-on state the next layers take"
                )
            self.state.update(self._pending[1])
        self._pending = None
        if self.between:
            outputs = [
                self._apply_between(layer.index, batch, out) for batch, out in enumerate(outputs)
            ]
        self.hidden = outputs
        self.next_layer += 1
        self._drop_state_before(self.next_layer)

    def _apply_between(self, layer: int, batch: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (layer ``layer``'s outputs on batch ``batch``) as the model body hands it
        to the next layer: the recorded calls made again on it."""
        for method, args, kwargs in self.between[batch].get(layer, []):
            hidden = method(hidden, *args, **kwargs)
        return hidden

    def _drop_state_before(self, layer: int) -> None:
        """Forget the kept state no call from ``layer`` on takes."""
        wanted = {
            source
            for call in (self.calls[0][layer:] if self.calls else [])
            for source in call.handed.values()
        }
        for key in [key for key in self.state if key not in wanted]:
            del self.state[key]

    def advance(self, layer: DecoderLayer, backend: Backend) -> None:
        """Run ``layer`` over every batch and make its outputs the next layer's inputs."""
        outputs = self.run(layer, backend, keep_outputs=True)
        assert outputs is not None
        self.commit(layer, outputs)


def _to_host(value: Any, device: torch.device) -> Any:
    """A returned tensor moved to ``device`` (where the hidden states are kept); else as is."""
    return value.detach().to(device) if isinstance(value, torch.Tensor) else value


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


class HandedOn:
    """Stands, during capture, for what decoder layer ``layer`` returns at ``position`` of its
    output tuple beside the hidden states: the recorders return these, so where the model body
    puts one into a later layer's call shows what it hands on, and to which argument."""

    __slots__ = ("layer", "position")

    def __init__(self, layer: int, position: int) -> None:
        self.layer = layer
        self.position = position

    def __repr__(self) -> str:
        return f"HandedOn(layer={self.layer}, position={self.position})"


class _Recorder(_LayerStandIn):
    """Stands in for a decoder layer during capture: records its inputs, returns them unchanged
    (and a :class:`HandedOn` where the layer returns more than its hidden states)."""

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
                    session.extra_outputs = len(output) - 1
                    session.returned = [
                        i for i, value in enumerate(output) if i and value is not None
                    ]
                    session.layer_type = type(self.real[0]).__name__
                    session.kinds = ", ".join(type(value).__name__ for value in output[1:])
        session.calls.append(LayerCall(args, dict(kwargs)))
        session.order.append(self.index)
        if not session.tuple_output:
            return hidden_states
        return (
            hidden_states,
            *(
                HandedOn(self.index, i) if i in session.returned else None
                for i in range(1, session.extra_outputs + 1)
            ),
        )


@dataclass
class _CaptureSession:
    calls: list[LayerCall] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    first_hidden: torch.Tensor | None = None
    tuple_output: bool | None = None
    #: the outputs a tuple-returning layer gives beside its hidden states
    extra_outputs: int = 0
    #: the positions of its output tuple where the first layer returned something (not None)
    returned: list[int] = field(default_factory=list)
    layer_type: str = ""
    kinds: str = ""
    #: what the body applied between layers in this forward (after layer -> calls)
    between: dict[int, BetweenLayers] = field(default_factory=dict)


def _link_handed_state(session: _CaptureSession, count: int) -> None:
    """Turn the :class:`HandedOn` stand-ins the model body put into the layers' calls into each
    :class:`LayerCall`'s ``handed`` (the argument holds None). A layer's returned state that no
    later layer takes as an argument (the body keeps it, or works with it) is refused, since the
    layer-wise run reproduces only what the body hands from layer to layer; so is one a layer
    gets nested in another argument."""
    consumed: set[tuple[int, int]] = set()
    for call in session.calls:
        slots: list[tuple[int | str, Any]] = [*enumerate(call.args), *call.kwargs.items()]
        for slot, value in slots:
            if isinstance(value, HandedOn):
                call.handed[slot] = (value.layer, value.position)
                consumed.add((value.layer, value.position))
            elif _holds_handed(value):
                raise ModelLoadError(_handed_message(session, "inside another argument"))
        if call.handed:
            args = list(call.args)
            for slot in call.handed:
                if isinstance(slot, int):
                    args[slot] = None
                else:
                    call.kwargs[slot] = None
            call.args = tuple(args)
    for layer in range(count - 1):  # what the last layer returns goes to no layer
        for position in session.returned:
            if (layer, position) not in consumed:
                raise ModelLoadError(_handed_message(session, "to no later layer"))


def _holds_handed(value: Any) -> bool:
    if isinstance(value, HandedOn):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_handed(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_handed(v) for v in value.values())
    return False


def _handed_message(session: _CaptureSession, how: str) -> str:
    return (
        f"{session.layer_type} returns more than its hidden states ({session.kinds} beside "
        f"them), which the model body passes on {how}: msquant runs the decoder layers one at a "
        "time from the hidden states and the arguments each received, carrying a layer's other "
        "outputs only into a later layer's call as a whole argument, so this architecture is not "
        "supported"
    )


def _recording_between(
    method: Callable[..., torch.Tensor], session: _CaptureSession
) -> Callable[..., torch.Tensor]:
    """``method`` (the body's between-layers method), recording each call after the layer that
    ran last in the session."""

    def record(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        after = session.order[-1] if session.order else -1
        session.between.setdefault(after, []).append((method, args, dict(kwargs)))
        return method(hidden_states, *args, **kwargs)

    return record


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
    media: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> CalibrationActivations:
    """Record the inputs of every decoder layer for the calibration samples (``[1, seq]``
    input_ids tensors), batched by :func:`batch_samples`.

    :param part: ``(rank, world_size)``: keep batches ``rank``, ``rank + world_size``, ... only
        (a process of a ``dp_layer_wise`` group calibrates on its share).
    :param media: per sample, the other inputs of a vision-language model's forward (image
        calibration): each sample is a batch of its own, run through the multimodal body.

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
    between: list[dict[int, BetweenLayers]] = []
    runner = body
    batches: list[tuple[torch.Tensor, Mapping[str, torch.Tensor] | None]] = [
        (ids, None) for ids in batch_samples(samples, max_batch_tokens)
    ]
    between_name = None
    if media is not None:
        runner, batches, between_name = _multimodal(model, body, samples, media)
    try:
        for i, real in enumerate(originals):
            layer_list[i] = _Recorder(i, real, session)
        if between_name is not None:
            setattr(body, between_name, _recording_between(getattr(body, between_name), session))
        rank, world_size = part
        for input_ids, inputs in batches[rank::world_size]:
            session.calls = []
            session.order = []
            session.first_hidden = None
            session.between = {}
            try:
                if inputs is None:
                    body(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        use_cache=False,
                    )
                else:
                    runner(input_ids=input_ids, **inputs, use_cache=False)
            except (TypeError, AttributeError, ValueError) as error:
                if not session.returned:
                    raise
                raise ModelLoadError(
                    _handed_message(session, f"into its own work ({error})")
                ) from error
            if session.order != list(range(len(originals))) or session.first_hidden is None:
                raise ModelLoadError(_order_message(body, session.order, len(originals)))
            if session.returned:
                _link_handed_state(session, len(originals))
                if calls and [c.handed for c in session.calls] != [c.handed for c in calls[0]]:
                    raise ModelLoadError(_handed_message(session, "differently between batches"))
            hidden.append(session.first_hidden.detach())
            calls.append(session.calls)
            between.append(session.between)
    finally:
        for i, real in enumerate(originals):
            layer_list[i] = real
        if between_name is not None and between_name in vars(body):
            delattr(body, between_name)
    activations = CalibrationActivations(hidden, calls, tuple_output=bool(session.tuple_output))
    if any(between):
        activations.between = between
    return activations


def _multimodal(
    model: nn.Module,
    body: nn.Module,
    samples: Sequence[torch.Tensor],
    media: Sequence[Mapping[str, torch.Tensor]],
) -> tuple[nn.Module, list[tuple[torch.Tensor, Mapping[str, torch.Tensor] | None]], str | None]:
    """The module run on image samples, the batches (one per sample, in order) and the name of
    the body's between-layers method (None when its family has none)."""
    name = multimodal_body_name(model)
    if name is None:
        raise ModelLoadError(
            f"{type(model).__name__} is not a vision-language model msquant knows the text "
            "decoder of, so it cannot be calibrated on images; calibrate it on text"
        )
    if len(media) != len(samples):
        raise ValueError(f"{len(samples)} image samples but {len(media)} sets of model inputs")
    method = between_layers_method(model)
    if method is not None and not callable(getattr(body, method, None)):
        method = None
    return model.get_submodule(name), list(zip(samples, media, strict=True)), method


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
