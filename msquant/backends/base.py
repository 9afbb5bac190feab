"""The device backend seam: every device-specific call of msquant goes through a :class:`Backend`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from msquant.backends.device import DeviceSpec

__all__ = ["Backend"]


class Backend(ABC):
    """Device placement, synchronisation, memory queries and the linear algebra GPTQ needs.

    One instance serves one device of one run. Subclasses implement :meth:`is_available` and
    :meth:`device_count`, and override the linear algebra where the device lacks a kernel.
    """

    kind: str

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.primary)

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this kind of device can be used in this process."""

    @classmethod
    @abstractmethod
    def device_count(cls) -> int:
        """How many devices of this kind are visible."""

    def to_device(self, module: nn.Module) -> nn.Module:
        """Move a module's parameters and buffers to this backend's device (in place)."""
        return module.to(self.device)

    def offload(self, module: nn.Module) -> nn.Module:
        """Move a module back to host memory after it was processed."""
        return module.to("cpu")

    def tensor_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` on this backend's device (the tensor itself if already there)."""
        return tensor.to(self.device)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

    def empty_cache(self) -> None:
        """Release cached device memory (no-op on CPU)."""

    def memory_allocated(self) -> int:
        """Bytes of device memory held by tensors (0 where the device does not report it)."""
        return 0

    def cholesky(self, matrix: torch.Tensor, upper: bool = False) -> torch.Tensor:
        """Cholesky factor of a symmetric positive-definite matrix, on the matrix's device."""
        return torch.linalg.cholesky(matrix, upper=upper)

    def solve_triangular(
        self, a: torch.Tensor, b: torch.Tensor, upper: bool, left: bool = True
    ) -> torch.Tensor:
        """Solve ``a x = b`` (or ``x a = b`` when ``left`` is False) for triangular ``a``."""
        return torch.linalg.solve_triangular(a, b, upper=upper, left=left)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"
