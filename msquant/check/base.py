"""What the transform checks need from a run (implemented by the runner's probe,
:class:`msquant.run.probe.TransformProbe`)."""

from __future__ import annotations

from typing import Protocol

import torch

from msquant.model.layers import DecoderLayer

__all__ = ["LayerRunner"]


class LayerRunner(Protocol):
    """The probe tokens' hidden states entering the current decoder layer, a way to run the
    layer on them, and the run report's record of every check."""

    @property
    def layer(self) -> DecoderLayer:
        """The decoder layer being processed."""
        ...

    @property
    def tokens(self) -> int:
        """Probe tokens per forward."""
        ...

    def describe(self) -> str:
        """What the probe is, for messages (``"73 calibration tokens"``)."""
        ...

    def hidden(self) -> torch.Tensor:
        """The hidden states entering the layer (float32 or wider)."""
        ...

    def run(self, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output hidden states on the probe (float32 or wider), computed on
        ``hidden`` instead of the probe's own input when given (same shape)."""
        ...

    def record(self, processor: str, check: str, error: float, tolerance: float) -> None:
        """Add one passed or failed check to the run report (``check``: what was compared)."""
        ...
