"""Prove, on data, that each pair a transform folds across is wired as the transform assumes.

A smoothing scale divides a producer's output channels (a norm's gain, a linear's rows) and
multiplies the same channels where they are read (the readers' weight columns); a rotation does
the same with an orthogonal matrix. Both are exact when, and only when, **scaling the producer's
output channel by channel scales the readers' inputs the same way, and reaches nothing else**.
That is what :func:`prove_flow` checks, on the probe tokens, before anything is folded:

1. a plain forward of the layer records each reader's input and output;
2. a second forward multiplies each producer's output by random per-channel factors (0.5 to 2),
   records the readers' inputs and replaces each reader's output by the one of the plain forward,
   so that what happens downstream of a reader is the plain forward again;
3. each reader's input must be its plain input times its producer's factors (mapped to the
   reader's channels: an attention output projection reads each key/value head's channels once
   per query head), and the layer's output must be the plain one: anything else reading a scaled
   producer would move it.

Pairs are independent in one forward: a reader's output is restored before a producer hook on the
same module scales it. A failed pair is refused with the layer, the pair and what was seen
(:class:`msquant.TransformCheckError`); the plain forward's output is returned so that the caller
can use it as the layer's reference output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from msquant.check.base import LayerRunner
from msquant.check.compare import FLOW_TOLERANCE, max_relative_error
from msquant.check.hooks import check_hook
from msquant.errors import TransformCheckError

__all__ = ["FlowPair", "ov_channel_map", "prove_flow"]

#: Seed of the per-channel factors.
FACTOR_SEED = 1234


@dataclass(frozen=True)
class FlowPair:
    """A producer whose output channels a transform scales, and the modules reading them.

    :param label: how messages name the pair (e.g. ``norm-linear input_layernorm -> q/k/v``).
    :param source: the producer's full module name.
    :param readers: the full module names of every module that must read the scaled channels.
    :param channel_map: for each input channel of the readers, the producer's output channel it
        reads (None: the same channel).
    """

    label: str
    source: str
    readers: tuple[str, ...]
    channel_map: torch.Tensor | None = None


def ov_channel_map(heads: int, kv_heads: int, width: int) -> torch.Tensor:
    """For each input channel of an attention output projection (``heads`` heads), the value
    projection's output channel it reads (``kv_heads`` heads, ``width`` channels): query head
    ``h`` reads key/value head ``h // (heads // kv_heads)``."""
    head_dim = width // kv_heads
    group = heads // kv_heads
    head = torch.arange(heads * head_dim) // head_dim
    return (head // group) * head_dim + torch.arange(heads * head_dim) % head_dim


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _detached(value: Any) -> Any:
    """A copy of ``value`` (a tensor, or tuples / lists of them) cut from the autograd graph."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


def _like(value: Any, current: Any) -> Any:
    """``value`` (recorded by :func:`_detached`) on the device and in the dtype of ``current``,
    or None when the two are not shaped alike."""
    if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
        if value.shape != current.shape:
            return None
        return value.to(current.device, current.dtype)
    if isinstance(value, (tuple, list)) and isinstance(current, (tuple, list)):
        if len(value) != len(current):
            return None
        parts = [_like(v, c) for v, c in zip(value, current, strict=True)]
        if any(p is None and c is not None for p, c in zip(parts, current, strict=True)):
            return None
        return type(current)(parts)
    return current if value is None or not isinstance(current, torch.Tensor) else None


class _FlowRecorder:
    """Forward hooks recording (and, in the scaled forward, changing) module inputs/outputs."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.outputs: dict[str, list[Any]] = {}

    def record(self, name: str, replace_with: dict[str, list[Any]] | None = None) -> None:
        """Record ``name``'s inputs and outputs; replace its outputs by ``replace_with[name]``
        (the same call's output of an earlier forward)."""
        self.inputs.setdefault(name, [])
        self.outputs.setdefault(name, [])

        @check_hook
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            x = _first_tensor(args)
            if x is not None:
                self.inputs[name].append(x.detach().clone())
            self.outputs[name].append(_detached(output))
            if replace_with is None:
                return None
            calls = replace_with.get(name, [])
            index = len(self.outputs[name]) - 1
            return _like(calls[index], output) if index < len(calls) else None

        self.handles.append(self.model.get_submodule(name).register_forward_hook(hook))

    def scale(self, name: str, factors: torch.Tensor) -> None:
        """Multiply ``name``'s output channels (last dimension) by ``factors``."""

        @check_hook
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not isinstance(output, torch.Tensor) or output.shape[-1] != factors.shape[0]:
                return None
            return output * factors.to(output.device, output.dtype)

        self.handles.append(self.model.get_submodule(name).register_forward_hook(hook))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _run(
    probe: LayerRunner, setup: Callable[[_FlowRecorder], None], model: nn.Module, hidden: Any
) -> tuple[_FlowRecorder, torch.Tensor]:
    recorder = _FlowRecorder(model)
    try:
        setup(recorder)
        output = probe.run(hidden)
    finally:
        recorder.close()
    return recorder, output


def _source_width(model: nn.Module, name: str) -> int | None:
    module = model.get_submodule(name)
    if isinstance(module, nn.Linear):
        return module.out_features
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None


def prove_flow(
    probe: LayerRunner,
    model: nn.Module,
    pairs: list[FlowPair],
    who: str,
    hidden: torch.Tensor | None = None,
    fix: str = "",
) -> torch.Tensor:
    """Check every pair's data flow on the probe (see the module doc); returns the layer's
    output of the plain forward.

    :param who: the processor, for messages and the run report.
    :param hidden: the layer's input, when not the probe's own (a rotation's unrotated input).
    :param fix: what the user can do when a pair does not hold (appended to the message).
    :raises TransformCheckError: naming the layer, each pair that does not hold and why.
    """
    layer = probe.layer.name
    readers = sorted({reader for pair in pairs for reader in pair.readers})

    def plain_setup(rec: _FlowRecorder) -> None:
        for name in readers:
            rec.record(name)

    plain, reference = _run(probe, plain_setup, model, hidden)
    generator = torch.Generator().manual_seed(FACTOR_SEED)
    factors: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for pair in pairs:
        width = _source_width(model, pair.source)
        if width is None:
            problems.append(f"{pair.label}: {pair.source} has no output channels to scale")
        elif pair.source not in factors:
            factors[pair.source] = torch.rand(width, generator=generator, dtype=torch.float64)
            factors[pair.source] = factors[pair.source] * 1.5 + 0.5
    scalable = [pair for pair in pairs if pair.source in factors]
    joint = _scaled_forward(probe, model, scalable, factors, plain, hidden)
    errors = joint.reader_errors(scalable, plain, factors)
    for pair, reader, error in errors:
        probe.record(who, f"data flow {pair.label}: {reader}", error, FLOW_TOLERANCE)
    leak = max_relative_error(reference, joint.output)
    probe.record(who, "data flow: nothing else reads a scaled output", leak, FLOW_TOLERANCE)
    failed = leak > FLOW_TOLERANCE or any(not e <= FLOW_TOLERANCE for _, _, e in errors)
    if failed or problems or len(errors) < len(scalable):
        problems += _diagnose(probe, model, scalable, factors, plain, reference, hidden)
    if problems:
        raise TransformCheckError(
            f"{who}: {layer}: the data flow the transform relies on does not hold on this model "
            f"(checked on {probe.describe()}): " + "; ".join(problems) + fix
        )
    return reference


@dataclass
class _Scaled:
    """One forward with producers scaled: what their readers read, and the layer's output."""

    recorder: _FlowRecorder
    output: torch.Tensor

    def reader_errors(
        self, pairs: list[FlowPair], plain: _FlowRecorder, factors: dict[str, torch.Tensor]
    ) -> list[tuple[FlowPair, str, float]]:
        """``(pair, reader, error)`` for each reader that ran in both forwards."""
        found = []
        for pair in pairs:
            factor = factors[pair.source]
            if pair.channel_map is not None:
                factor = factor[pair.channel_map]
            for reader in pair.readers:
                before, after = plain.inputs.get(reader), self.recorder.inputs.get(reader)
                if before and after:
                    found.append((pair, reader, _scaled_error(before, after, factor)))
        return found


def _scaled_forward(
    probe: LayerRunner,
    model: nn.Module,
    pairs: list[FlowPair],
    factors: dict[str, torch.Tensor],
    plain: _FlowRecorder,
    hidden: torch.Tensor | None,
) -> _Scaled:
    """Scale the producers of ``pairs``, record their readers' inputs and hold their outputs."""
    readers = sorted({reader for pair in pairs for reader in pair.readers})

    def setup(rec: _FlowRecorder) -> None:
        for name in readers:
            rec.record(name, replace_with=plain.outputs)
        for source in dict.fromkeys(pair.source for pair in pairs):
            rec.scale(source, factors[source])

    recorder, output = _run(probe, setup, model, hidden)
    return _Scaled(recorder, output)


def _diagnose(
    probe: LayerRunner,
    model: nn.Module,
    pairs: list[FlowPair],
    factors: dict[str, torch.Tensor],
    plain: _FlowRecorder,
    reference: torch.Tensor,
    hidden: torch.Tensor | None,
) -> list[str]:
    """What does not hold, pair by pair: each pair's producer scaled alone (one forward each,
    run only when the joint forward failed, so that a pair broken by another one's leak is not
    blamed)."""
    layer = probe.layer.name
    found = []
    for pair in pairs:
        alone = _scaled_forward(probe, model, [pair], factors, plain, hidden)
        errors = alone.reader_errors([pair], plain, factors)
        source = _short(pair.source, layer)
        if not errors:
            found.append(
                f"{pair.label}: none of its readers ran on the probe tokens, so its data flow "
                "cannot be proven"
            )
            continue
        wrong = {_short(r, layer): e for _, r, e in errors if not e <= FLOW_TOLERANCE}
        if wrong:
            found.append(
                f"{pair.label}: the input of {', '.join(wrong)} does not follow {source}'s output "
                f"channel by channel (error {max(wrong.values()):.3g} when {source}'s channels "
                f"are scaled): {'it does' if len(wrong) == 1 else 'they do'} not read {source}'s "
                "output"
            )
            continue
        error = max_relative_error(reference, alone.output)
        if error > FLOW_TOLERANCE:
            readers = ", ".join(_short(r, layer) for r in pair.readers)
            found.append(
                f"{pair.label}: {source}'s output reaches the layer's output other than through "
                f"{readers} (the output moved by {error:.3g} with those readers' outputs held): "
                "another module reads it, and a fold would change that module's input too"
            )
    return found or [
        "scaling the producers' outputs together moved the layer's output although no pair "
        "alone does (the pairs interact)"
    ]


def _short(name: str, layer: str) -> str:
    """``name`` relative to the decoder layer ``layer``."""
    return name[len(layer) + 1 :] if name.startswith(layer + ".") else name


def _scaled_error(
    before: list[torch.Tensor], after: list[torch.Tensor], factor: torch.Tensor
) -> float:
    """The worst :func:`max_relative_error` of ``after`` against ``before`` times ``factor``
    over every call recorded (inf when the calls or the widths differ)."""
    if len(before) != len(after):
        return float("inf")
    worst = 0.0
    for plain, scaled in zip(before, after, strict=True):
        if plain.shape[-1] != factor.shape[0]:
            return float("inf")
        expected = plain.detach().to("cpu", torch.float64) * factor
        worst = max(worst, max_relative_error(expected, scaled))
    return worst
