"""What a smoothing processor gathers from the calibration forward: per subgraph, the per-channel
absolute maximum of the input of its first linear layer, and for the alpha/beta search (and
``flex_awq_ssz``'s mean absolute activation) the input rows themselves."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from msquant.plugin.numerics import update_channel_max
from msquant.processors.smoothing.awq_search import mean_abs

__all__ = ["InputStatistics", "evenly_spaced"]


def evenly_spaced(count: int, limit: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices of ``limit`` of ``count`` items, evenly spaced from the first to the last (all
    ``count`` when ``count <= limit``), ascending, on ``device`` (where they are computed)."""
    if count <= limit:
        return torch.arange(count, device=device)
    return torch.linspace(0, count - 1, limit, device=device).round().long()


class InputStatistics:
    """Forward hooks recording the inputs of named linear layers during one calibration pass."""

    def __init__(self, keep_rows: bool) -> None:
        #: also keep every input row (``[tokens, in]``), for the alpha/beta search
        self.keep_rows = keep_rows
        self.channel_max: dict[str, torch.Tensor] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}
        self._handles: list[RemovableHandle] = []

    def hook(self, name: str, module: nn.Module) -> None:
        """Record the inputs of ``module`` (named ``name``) from now on."""

        def record(_module: nn.Module, inputs: tuple[Any, ...], _output: Any) -> None:
            x = inputs[0].detach()
            if x.numel() == 0:
                return
            self.channel_max[name] = update_channel_max(self.channel_max.get(name), x)
            if self.keep_rows:
                self.rows.setdefault(name, []).append(x.reshape(-1, x.shape[-1]))

        self._handles.append(module.register_forward_hook(record))

    def unhook(self) -> None:
        """Stop recording (what was recorded stays)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def spaced_rows(self, name: str, limit: int) -> torch.Tensor | None:
        """At most ``limit`` recorded input rows of ``name``, evenly spaced over all of them:
        ``torch.cat(self.rows[name])[evenly_spaced(count, limit)]``, gathered from the recorded batches
        without joining them all first (``[min(count, limit), in]``, or None)."""
        batches = self.rows.get(name)
        if not batches:
            return None
        count = sum(batch.shape[0] for batch in batches)
        if count <= limit:
            return torch.cat(batches, dim=0)
        index = evenly_spaced(count, limit, batches[0].device)
        picked, start = [], 0
        for batch in batches:
            end = start + batch.shape[0]
            inside = index[(index >= start) & (index < end)]
            if inside.numel():
                picked.append(batch[inside - start])
            start = end
        return torch.cat(picked, dim=0)

    def mean_abs(self, name: str) -> torch.Tensor | None:
        """The per-channel mean of ``|x|`` over every recorded input row of ``name`` (None when
        it saw none; needs ``keep_rows``)."""
        batches = self.rows.get(name)
        return mean_abs(batches) if batches else None

    def clear(self) -> None:
        """Forget everything recorded (the next layer starts afresh)."""
        self.unhook()
        self.channel_max.clear()
        self.rows.clear()
