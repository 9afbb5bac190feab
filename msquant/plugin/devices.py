"""Devices: the backend a processor runs its numerics on and how a device string parses.
Part of the plugin API (docs/api.md).
"""

from msquant.backends import (
    Backend,
    DeviceSpec,
    get_backend,
    parse_device,
)

__all__ = [
    "Backend",
    "DeviceSpec",
    "get_backend",
    "parse_device",
]
