"""A layer's tensors kept on the host, to put the layer back exactly as it was.

A transform applied in several steps is checked once, after the last step; when that check fails,
the layer is restored from its snapshot and the steps are applied again one at a time, each
checked, so that the failure names the step (the run stops either way: the restored layer is
never exported). The copies live in host memory, never on the device.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LayerSnapshot"]


class LayerSnapshot:
    """Host copies of every parameter and buffer of ``module``, and which modules had which."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.parameters: dict[tuple[int, str], torch.Tensor | None] = {}
        self.buffers: dict[tuple[int, str], torch.Tensor | None] = {}
        self.modules = dict(module.named_modules())
        for sub in self.modules.values():
            for key, param in sub._parameters.items():
                self.parameters[(id(sub), key)] = _host(param)
            for key, buffer in sub._buffers.items():
                self.buffers[(id(sub), key)] = _host(buffer)

    @torch.no_grad()
    def restore(self) -> None:
        """Give every parameter and buffer its recorded value back (in place, on its device);
        parameters a step added are removed."""
        for sub in self.modules.values():
            for key in list(sub._parameters):
                if (id(sub), key) not in self.parameters:
                    del sub._parameters[key]
                    continue
                saved = self.parameters[(id(sub), key)]
                current = sub._parameters[key]
                if saved is None:
                    sub._parameters[key] = None
                elif current is not None:
                    current.data = saved.to(current.device, current.dtype)
            for key in list(sub._buffers):
                saved_buffer = self.buffers.get((id(sub), key))
                current_buffer = sub._buffers[key]
                if saved_buffer is not None and current_buffer is not None:
                    sub._buffers[key] = saved_buffer.to(current_buffer.device, current_buffer.dtype)


def _host(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().to("cpu", copy=True)
