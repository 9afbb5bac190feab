"""Counting NaN and Inf in a tensor (checks of loaded checkpoints and of exported tensors)."""

from __future__ import annotations

import torch

__all__ = ["non_finite_count"]


def non_finite_count(tensor: torch.Tensor) -> int:
    """How many NaN/Inf values a floating-point tensor holds (0 for other dtypes). One-byte
    floats (float8) are widened first: torch has no ``isfinite`` for them."""
    if not tensor.is_floating_point() or tensor.is_meta:
        return 0
    if tensor.element_size() == 1:
        tensor = tensor.to(torch.float16)
    return int((~torch.isfinite(tensor)).sum())
