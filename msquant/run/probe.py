"""The probe of a run's transform checks: a few calibration tokens pushed through the model
beside the calibration set, on which every function-preserving transform proves itself.

A run whose processors transform weights (``Processor.transforms_weights``: smoothing, rotation)
gets a :class:`TransformProbe` in ``ctx.probe``. It holds the first :data:`PROBE_TOKENS` tokens of
the first calibration sample (or, for a run without calibration data, as many seeded random token
ids), captures the hidden states they bring to the first decoder layer once the processors are set
up, and after each layer pushes them through the processed layer to the next one. A checkpointed
run records them after each layer (:meth:`TransformProbe.entering`); a resumed run takes them up
(:meth:`TransformProbe.resume_at`). The checks of
:mod:`msquant.check` run the current layer on them (:meth:`TransformProbe.run`, in float32 for
16-bit layers) and record what they found (:meth:`TransformProbe.record`); the runner puts the
records and the probe's time into the run report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from msquant.backends.base import Backend
from msquant.check.compare import FLOW_TOLERANCE
from msquant.check.hooks import without_foreign_hooks
from msquant.check.upcast import float32_copy, in_float32
from msquant.model.layers import DecoderLayer
from msquant.report.run_report import RunReport, TransformCheck
from msquant.run.capture import (
    CalibrationActivations,
    capture_layer_inputs,
    first_layer_input,
    tree_to_device,
)

__all__ = ["PROBE_SEED", "PROBE_TOKENS", "TransformProbe", "probe_input_ids"]

#: Tokens of the probe: enough for every attention pattern of a layer (sliding windows, the first
#: token's attention sink) at a small fraction of a calibration pass.
PROBE_TOKENS = 256
#: Seed of the random token ids of a run without calibration data.
PROBE_SEED = 0


def probe_input_ids(samples: Sequence[torch.Tensor] | None, vocab_size: int) -> torch.Tensor:
    """``[1, n]`` probe token ids: the start of the first calibration sample, or seeded random
    ids below ``vocab_size`` when the run has no calibration data."""
    if samples:
        return samples[0][:1, :PROBE_TOKENS].clone()
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, max(vocab_size, 1), (1, PROBE_TOKENS), generator=generator)


def _vocab_size(model: nn.Module) -> int:
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    size = getattr(embedding, "num_embeddings", None)
    return int(size) if isinstance(size, int) else 2


class TransformProbe:
    """The probe tokens' hidden states entering the current layer (see the module doc); one
    instance serves one call of the layer runner.

    :param model: the model of the run; ``layers`` its decoder layers.
    :param samples: the run's calibration samples (None without calibration data).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[DecoderLayer],
        backend: Backend,
        samples: Sequence[torch.Tensor] | None,
    ) -> None:
        self.model = model
        self.layers = layers
        self.backend = backend
        self.input_ids = probe_input_ids(samples, _vocab_size(model))
        self.kind = "calibration" if samples else "random"
        self.seconds = 0.0
        self._activations: CalibrationActivations | None = None
        self._layer: DecoderLayer | None = None
        self._records: dict[str, dict[str, Any]] = {}

    # -- the run's side -----------------------------------------------------------------------

    def capture(self) -> None:
        """Record the probe's inputs of the first layer (after the processors' setup)."""
        started = time.perf_counter()
        self._activations = capture_layer_inputs(
            self.model, self.layers, [self.input_ids], max_batch_tokens=self.input_ids.numel()
        )
        self.seconds += time.perf_counter() - started

    @property
    def activations(self) -> CalibrationActivations | None:
        """The probe's captured layer calls and current hidden states (None before
        :meth:`capture`)."""
        return self._activations

    def entering(self) -> torch.Tensor:
        """The probe's hidden states entering the next layer, as they are (for a checkpoint)."""
        if self._activations is None:
            raise RuntimeError("the probe's inputs are captured after the processors' setup")
        return self._activations.hidden[0]

    def resume_at(self, index: int, hidden: torch.Tensor) -> None:
        """Take up the hidden states a checkpoint recorded as entering layer ``index`` (after
        :meth:`capture`, in place of the first layer's inputs).

        :raises ValueError: when their shape or dtype are not those of the captured inputs.
        """
        if self._activations is None:
            raise RuntimeError("the probe's inputs are captured after the processors' setup")
        captured = self._activations.hidden[0]
        if hidden.shape != captured.shape or hidden.dtype != captured.dtype:
            raise ValueError(
                f"the probe's hidden states {tuple(hidden.shape)} {hidden.dtype} are not those of "
                f"this run's probe {tuple(captured.shape)} {captured.dtype}"
            )
        self._activations.hidden = [hidden.to(captured.device)]
        self._activations.next_layer = index

    def enter(self, layer: DecoderLayer) -> None:
        """``layer`` is the next one processed (its inputs are the probe's current hidden)."""
        self._layer = layer
        self._records = {}

    def leave(self, layer: DecoderLayer, report: RunReport) -> float:
        """Push the probe through the processed ``layer``, put its checks into ``report``; returns
        the probe's seconds for this layer (checks and push)."""
        assert self._activations is not None
        started = time.perf_counter()
        self._activations.advance(layer, self.backend)
        self.seconds += time.perf_counter() - started
        for processor, found in self._records.items():
            report.add_transform_check(
                TransformCheck(
                    layer=layer.index,
                    processor=processor,
                    flow_checks=found["flow_checks"],
                    flow_error=found["flow_error"],
                    function_checks=found["function_checks"],
                    function_error=found["function_error"],
                    function_tolerance=found["function_tolerance"],
                )
            )
        self._layer = None
        spent, self.seconds = self.seconds, 0.0
        return spent

    # -- the checks' side (msquant.check.base.LayerRunner) -------------------------------------

    @property
    def layer(self) -> DecoderLayer:
        """The decoder layer being processed."""
        if self._layer is None:
            raise RuntimeError("the probe is used outside a decoder layer")
        return self._layer

    @property
    def tokens(self) -> int:
        """Probe tokens per forward."""
        return int(self.input_ids.numel())

    def describe(self) -> str:
        """What the probe is, for messages (``"73 calibration tokens"``)."""
        return f"{self.tokens} {self.kind} tokens"

    def hidden(self) -> torch.Tensor:
        """The hidden states entering the current layer (float32 for a 16-bit model)."""
        if self._activations is None:
            raise RuntimeError("the probe's inputs are captured after the processors' setup")
        return float32_copy(self._activations.hidden[0])

    def first_layer_input(self) -> torch.Tensor:
        """The hidden states the model (as it is now) feeds its first decoder layer for the probe
        tokens, float32 or wider; no decoder layer runs (a transform of the embeddings checks
        itself with it before and after)."""
        started = time.perf_counter()
        hidden = float32_copy(first_layer_input(self.model, self.layers, self.input_ids))
        self.seconds += time.perf_counter() - started
        return hidden

    @torch.no_grad()
    def run(self, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The current layer's output on the probe (on ``hidden`` instead of the probe's input
        when given), computed in float32 for a 16-bit layer; on the host."""
        assert self._activations is not None
        layer = self.layer
        started = time.perf_counter()
        call_args, call_kwargs = self._activations.arguments(0, layer.index)
        inputs = self.hidden() if hidden is None else hidden
        with in_float32(layer.module) as upcast, without_foreign_hooks(layer.module):
            args, kwargs = (
                float32_copy((call_args, call_kwargs)) if upcast else (call_args, call_kwargs)
            )
            device = self.backend
            result = layer.module(
                device.tensor_to_device(inputs.to(_compute_dtype(layer.module, upcast))),
                *tree_to_device(args, device),
                **tree_to_device(kwargs, device),
            )
        out = result[0] if isinstance(result, tuple) else result
        out = out.detach().to("cpu")
        self.seconds += time.perf_counter() - started
        return out if out.dtype != torch.float16 and out.dtype != torch.bfloat16 else out.float()

    def record(self, processor: str, check: str, error: float, tolerance: float) -> None:
        """Count one check of ``processor`` on the current layer and keep its worst error."""
        found = self._records.setdefault(
            processor,
            {
                "flow_checks": 0,
                "flow_error": None,
                "function_checks": 0,
                "function_error": None,
                "function_tolerance": None,
            },
        )
        kind = "flow" if check.startswith("data flow") else "function"
        found[f"{kind}_checks"] += 1
        worst = found[f"{kind}_error"]
        found[f"{kind}_error"] = error if worst is None else max(worst, error)
        if kind == "function":
            found["function_tolerance"] = tolerance
        elif tolerance != FLOW_TOLERANCE:  # pragma: no cover - one tolerance today
            raise ValueError(f"data-flow tolerance {tolerance} is not {FLOW_TOLERANCE}")


def _compute_dtype(module: nn.Module, upcast: bool) -> torch.dtype:
    if upcast:
        return torch.float32
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32
