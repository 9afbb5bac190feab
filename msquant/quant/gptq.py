"""The GPTQ quantizer of one layer: :class:`GPTQQuantizer`, and msModelSlim's two names for it.

A quantizer accumulates its layer's Hessian from calibration activations (:meth:`add_batch`) and
then quantizes the layer's weight (:meth:`quantize`) with the solve of
:func:`msquant.quant.gptq_solver.gptq_quantize`, under one frozen :class:`GPTQOptions`
(``group_size=None``: per-channel). :class:`WeightPerChannelGPTQ` and :class:`WeightPerGroupGPTQ`
are msModelSlim's class names, kept as thin constructors taking the options as keywords.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from msquant.backends.base import Backend
from msquant.quant.gptq_options import GPTQ_EXT_DEFAULTS, GPTQOptions
from msquant.quant.gptq_solver import GPTQResult, gptq_quantize
from msquant.quant.hessian import HessianAccumulator

__all__ = [
    "GPTQOptions",
    "GPTQResult",
    "GPTQQuantizer",
    "WeightPerChannelGPTQ",
    "WeightPerGroupGPTQ",
    "HessianAccumulator",
    "gptq_quantize",
    "GPTQ_EXT_DEFAULTS",
]


class GPTQQuantizer:
    """GPTQ for one layer: a Hessian accumulator plus the options its solve runs with.

    ``accumulator`` (a :class:`HessianAccumulator`) holds the layer's ``X^T X`` and token count;
    :meth:`quantize` solves from it without copying it, and may be called more than once.

    :param options: the solve's options (validated where they were built).
    :param name: module name for messages.
    :param in_features: expected input width (taken from the first batch when None).
    """

    def __init__(
        self, options: GPTQOptions, name: str = "layer", in_features: int | None = None
    ) -> None:
        self.options = options
        self.name = name
        self.accumulator = HessianAccumulator(in_features, name=name)

    @property
    def group_size(self) -> int | None:
        """Input columns per group, None per-channel."""
        return self.options.group_size

    @property
    def nsamples(self) -> int:
        """Calibration tokens accumulated so far (padding excluded)."""
        return self.accumulator.n

    def add_batch(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Accumulate the Hessian from one batch of layer inputs ``[..., in_features]``.

        :param attention_mask: optional, shaped like ``x.shape[:-1]``; zeros mark padding tokens.
        """
        self.accumulator.add_batch(x, attention_mask)

    def free(self) -> None:
        """Drop the accumulated Hessian (memory is released; ``add_batch`` starts over)."""
        self.accumulator.free()

    def quantize(self, weight: torch.Tensor, backend: Backend | None = None) -> GPTQResult:
        """Quantize ``weight`` (``[out, in]``, any floating dtype) with the accumulated Hessian.

        :param backend: runs the Cholesky and triangular solves (``CpuBackend`` when None).
        :raises QuantizationError: no batch was accumulated, shapes disagree, or the checks of
            :func:`gptq_quantize` fail.
        """
        raw, count = self.accumulator.raw_sum()
        return gptq_quantize(
            weight,
            raw,
            self.options,
            name=self.name,
            backend=backend,
            hessian_scale=2.0 / count,
            nsamples=count,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, {self.options})"


class WeightPerChannelGPTQ(GPTQQuantizer):
    """msModelSlim's per-channel GPTQ: :class:`GPTQQuantizer` with ``group_size=None``.

    :param bits: code width (8 for int8, 4 for int4; 2..8 accepted).
    :param symmetric: zero offset (True) or signed zero point (False).
    :param options: any other field of :class:`GPTQOptions` by its YAML ``ext`` name
        (``percdamp``, ``block_size``, ``desc_act``, ``mse`` with ``mse_grid`` ..., ``full_range``).
    :raises QuantizationError: ``<name>: invalid GPTQ options: ...``.
    """

    def __init__(
        self,
        bits: int = 8,
        symmetric: bool = True,
        *,
        name: str = "layer",
        in_features: int | None = None,
        **options: Any,
    ) -> None:
        flat = dict(bits=bits, symmetric=symmetric, group_size=None, **options)
        super().__init__(GPTQOptions.from_flat(name, **flat), name, in_features)

    @classmethod
    def from_ext(
        cls, bits: int, symmetric: bool, ext: Mapping[str, Any], name: str = "layer"
    ) -> GPTQQuantizer:
        """Build from a YAML ``ext`` mapping (``group_size`` is ignored per-channel; None = default)."""
        return GPTQQuantizer(
            GPTQOptions.from_ext(bits, symmetric, ext, name, per_group=False), name
        )


class WeightPerGroupGPTQ(GPTQQuantizer):
    """msModelSlim's per-group GPTQ: :class:`GPTQQuantizer` with a ``group_size`` (default 128).

    Parameters as :class:`WeightPerChannelGPTQ`, plus ``group_size`` (must divide in_features) and
    ``static_groups`` (forced on with ``desc_act``, so the group index stays trivial).
    """

    def __init__(
        self,
        bits: int = 8,
        symmetric: bool = True,
        *,
        group_size: int = 128,
        name: str = "layer",
        in_features: int | None = None,
        **options: Any,
    ) -> None:
        flat = dict(bits=bits, symmetric=symmetric, group_size=group_size, **options)
        super().__init__(GPTQOptions.from_flat(name, **flat), name, in_features)

    @classmethod
    def from_ext(
        cls, bits: int, symmetric: bool, ext: Mapping[str, Any], name: str = "layer"
    ) -> GPTQQuantizer:
        """Build from a YAML ``ext`` mapping (keys of :data:`GPTQ_EXT_DEFAULTS`; None = default)."""
        return GPTQQuantizer(GPTQOptions.from_ext(bits, symmetric, ext, name), name)
