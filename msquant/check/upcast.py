"""Run a 16-bit layer in float32 for a check, then give it back exactly as it was.

A check compares the outputs of a layer before and after a transform. Computed in bfloat16, each
output carries its own rounding (about 0.4 % of every value), which would hide a wrong transform
of that size. So 16-bit parameters and buffers are swapped for float32 copies during the check's
forward (the inputs too), and the original tensors are put back afterwards: the layer is never
rounded twice, and what the check measures is the transform's real effect (its weights rounded
to 16 bits included).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["SIXTEEN_BIT", "float32_copy", "in_float32"]

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def float32_copy(value: Any) -> Any:
    """``value`` with every 16-bit float tensor inside (tuples, lists, dicts) cast to float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in SIXTEEN_BIT else value
    if isinstance(value, tuple):
        return tuple(float32_copy(v) for v in value)
    if isinstance(value, list):
        return [float32_copy(v) for v in value]
    if isinstance(value, dict):
        return {k: float32_copy(v) for k, v in value.items()}
    return value


@contextmanager
def in_float32(module: nn.Module) -> Iterator[bool]:
    """Within the block, ``module``'s 16-bit parameters and buffers are float32 copies; the
    original tensors are restored on exit. Yields whether anything was swapped."""
    swapped: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    try:
        for sub in module.modules():
            for name, param in sub.named_parameters(recurse=False):
                if param.dtype in SIXTEEN_BIT:
                    swapped.append((sub, name, True, param.data))
                    param.data = param.data.float()
            for name, buffer in sub.named_buffers(recurse=False):
                if buffer.dtype in SIXTEEN_BIT:
                    swapped.append((sub, name, False, buffer))
                    sub._buffers[name] = buffer.float()
        yield bool(swapped)
    finally:
        for sub, name, is_param, original in reversed(swapped):
            if is_param:
                getattr(sub, name).data = original
            else:
                sub._buffers[name] = original
