"""The CPU backend: plain torch, always available."""

from __future__ import annotations

from msquant.backends.base import Backend

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    """Runs everything on the host CPU."""

    kind = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def device_count(cls) -> int:
        return 1
