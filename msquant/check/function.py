"""The self-check of a function-preserving transform: the layer's output on the probe tokens must
not move.

:class:`FunctionCheck` holds the layer's output before the transform (given, when the caller has
it from a plain forward over the unchanged layer, else computed) and compares each later output
with the previous one (:func:`msquant.check.compare.update_error`, relative to what the layer adds
to its input), so that a transform applied in steps (one smoothing subgraph after the other) is
checked step by step and a failure names the step. A transform that changes the basis of the
layer's input and output (a rotation) gives the maps between the two bases.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from msquant.check.base import LayerRunner
from msquant.check.compare import function_tolerance, update_error
from msquant.errors import TransformCheckError

__all__ = ["FunctionCheck", "layer_fingerprint", "weight_dtype"]

Map = Callable[[torch.Tensor], torch.Tensor]


def layer_fingerprint(module: nn.Module) -> tuple[tuple[int, int, int], ...]:
    """Identity, storage and in-place version of every parameter and buffer of ``module``: it
    changes whenever a weight is replaced or modified in place (so an output computed before is
    no longer the layer's)."""
    tensors = [*module.parameters(), *module.buffers()]
    return tuple((id(t), t.data_ptr(), t._version) for t in tensors)


def weight_dtype(module: nn.Module) -> torch.dtype:
    """The narrowest floating dtype among ``module``'s parameters (what a fold rounds to)."""
    dtypes = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return min(dtypes, key=lambda d: torch.finfo(d).bits, default=torch.float32)


class FunctionCheck:
    """Compare a layer's probe outputs across the steps of a transform.

    :param probe: the run's probe of the current layer.
    :param who: the processor (messages, run report).
    :param reference: the layer's output before the transform, when the caller computed it on
        the unchanged layer (the plain forward of :func:`msquant.check.flow.prove_flow`).
    :param to_original: maps the probe's input to the layer's input before the transform (a
        rotation's ``x @ R.T``); the reference is then computed on that input.
    :param from_transformed: maps the transformed layer's output back to the original basis.
    :param fix: appended to the message of a failed check.
    """

    def __init__(
        self,
        probe: LayerRunner,
        who: str,
        reference: torch.Tensor | None = None,
        to_original: Map | None = None,
        from_transformed: Map | None = None,
        fix: str = "",
    ) -> None:
        self.probe = probe
        self.who = who
        self.fix = fix
        self.from_transformed = from_transformed
        self.original_input = probe.hidden() if to_original is None else to_original(probe.hidden())
        self.previous = reference if reference is not None else probe.run(self.original_input)
        self.tolerance = function_tolerance(weight_dtype(probe.layer.module))
        self.worst = 0.0

    def verify(self, step: str) -> float:
        """Run the layer after ``step`` and compare with the output before it.

        :returns: the error (:func:`~msquant.check.compare.update_error`).
        :raises TransformCheckError: when it exceeds the tolerance, naming the layer and step.
        """
        output = self.probe.run()
        if self.from_transformed is not None:
            output = self.from_transformed(output)
        error = update_error(self.original_input, self.previous, output)
        self.probe.record(self.who, f"function after {step}", error, self.tolerance)
        if not error <= self.tolerance:
            raise TransformCheckError(
                f"{self.who}: {self.probe.layer.name}: after {step} the layer computes something "
                f"else on {self.probe.describe()} (its outputs moved by "
                f"{error:.3g} of what the layer adds to its input; at most {self.tolerance:g} is "
                f"float rounding): the transform does not keep this model's function, so the "
                f"run stops before anything is written{self.fix}"
            )
        self.previous = output
        self.worst = max(self.worst, error)
        return error
