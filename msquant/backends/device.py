"""Parse and validate device strings: ``cpu``, ``cuda``, ``cuda:1``, ``npu``, ``npu:0``, ``npu:0,1,2,3``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, cast

from msquant.errors import DeviceError

__all__ = ["DeviceKind", "DeviceSpec", "parse_device"]

DeviceKind = Literal["cpu", "cuda", "npu"]
KINDS: tuple[DeviceKind, ...] = ("cpu", "cuda", "npu")
_PATTERN = re.compile(r"^(?P<kind>[a-z]+)(?::(?P<indices>\d+(?:,\d+)*))?$")


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string: its kind and the device indices it names (``()`` = default)."""

    kind: DeviceKind
    indices: tuple[int, ...] = ()

    @property
    def primary(self) -> str:
        """The torch device string of the first device (``"cpu"``, ``"cuda:0"``, ``"npu:2"``)."""
        if self.kind == "cpu":
            return "cpu"
        return f"{self.kind}:{self.indices[0] if self.indices else 0}"

    def __str__(self) -> str:
        if not self.indices:
            return self.kind
        return f"{self.kind}:{','.join(map(str, self.indices))}"


def parse_device(text: str) -> DeviceSpec:
    """Parse a device string (msModelSlim syntax, plus ``cuda``).

    :raises DeviceError: for malformed strings, unknown kinds, repeated indices or ``cpu:N``.
    """
    match = _PATTERN.match(text.strip().lower())
    valid = "cpu, cuda, cuda:N, npu, npu:N or npu:N,M,..."
    if match is None:
        raise DeviceError(f"malformed device {text!r}; valid forms: {valid}")
    kind = match.group("kind")
    if kind not in KINDS:
        raise DeviceError(f"unknown device type {kind!r} in {text!r}; valid forms: {valid}")
    indices = (
        tuple(int(i) for i in match.group("indices").split(",")) if match.group("indices") else ()
    )
    if kind == "cpu" and indices:
        raise DeviceError(f"device {text!r}: the CPU takes no index; use 'cpu'")
    if len(set(indices)) != len(indices):
        raise DeviceError(f"device {text!r} repeats a device index")
    return DeviceSpec(cast(DeviceKind, kind), indices)
