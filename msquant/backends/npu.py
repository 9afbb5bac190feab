"""The Ascend NPU backend. ``torch_npu`` is imported here, lazily, and nowhere else in msquant."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from msquant.backends.base import Backend

__all__ = ["NpuBackend", "import_torch_npu"]


def import_torch_npu() -> ModuleType | None:
    """Import ``torch_npu`` (registering the ``npu`` device with torch), or None if not installed."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def _npu() -> Any:
    return getattr(torch, "npu")  # noqa: B009 - attribute exists only after torch_npu is imported


class NpuBackend(Backend):
    """Runs layer work on one Ascend NPU.

    Linear algebra without NPU kernels (Cholesky, triangular solves) runs on the host CPU and the
    result is moved back, as the NPU falls back to CPU for ``linalg_cholesky`` anyway.
    """

    kind = "npu"

    @classmethod
    def is_available(cls) -> bool:
        return import_torch_npu() is not None and bool(_npu().is_available())

    @classmethod
    def device_count(cls) -> int:
        return int(_npu().device_count()) if cls.is_available() else 0

    def synchronize(self) -> None:
        _npu().synchronize(self.device)

    def empty_cache(self) -> None:
        _npu().empty_cache()

    def memory_allocated(self) -> int:
        return int(_npu().memory_allocated(self.device))

    def cholesky(self, matrix: torch.Tensor, upper: bool = False) -> torch.Tensor:
        return torch.linalg.cholesky(matrix.cpu(), upper=upper).to(matrix.device)

    def solve_triangular(
        self, a: torch.Tensor, b: torch.Tensor, upper: bool, left: bool = True
    ) -> torch.Tensor:
        result = torch.linalg.solve_triangular(a.cpu(), b.cpu(), upper=upper, left=left)
        return result.to(b.device)
