"""The CUDA backend (NVIDIA GPUs through torch.cuda)."""

from __future__ import annotations

import torch

from msquant.backends.base import Backend

__all__ = ["CudaBackend"]


class CudaBackend(Backend):
    """Runs layer work on one CUDA device."""

    kind = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        return bool(torch.cuda.is_available())

    @classmethod
    def device_count(cls) -> int:
        return int(torch.cuda.device_count()) if cls.is_available() else 0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))
