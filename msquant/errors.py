"""Typed exceptions raised by msquant.

Every error a user can cause derives from :class:`MsquantInputError`; the CLI maps it to exit code 2
and prints its message without a traceback. Anything else escaping the engine is an internal failure
(exit code 1). Embedders catch these classes instead of parsing messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from msquant.registry_base import PluginProblem

__all__ = [
    "MsquantError",
    "MsquantInputError",
    "ConfigIssue",
    "ConfigError",
    "ModelLoadError",
    "CalibrationDataError",
    "DeviceError",
    "OutputPathError",
    "QuantizationError",
    "TransformCheckError",
    "NotImplementedYetError",
    "RegistryError",
    "PluginError",
    "validation_message",
]

#: pydantic error types whose message already names the input, or where it has none to echo.
_UNECHOED_TYPES = frozenset(
    {"missing", "extra_forbidden", "union_tag_invalid", "union_tag_not_found"}
)
#: Longest echoed input before it is shortened.
_ECHO_LIMIT = 60


class MsquantError(Exception):
    """Base class of every exception msquant raises on purpose."""


class MsquantInputError(MsquantError):
    """The user's input (config, paths, model, data, device) is wrong; the message says how to fix it."""


@dataclass(frozen=True)
class ConfigIssue:
    """One problem found in a config, located by its dotted YAML path (e.g. ``spec.process[0].type``)."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.message}"


def validation_message(error: Mapping[str, Any]) -> str:
    """The message of one pydantic error, with the value that was given when it is a scalar.

    pydantic says what it expected (``Input should be 'per_tensor', 'per_channel', ...``) but not
    what it got; a user reading the message should not have to search the YAML for it.

    :param error: one item of ``ValidationError.errors()``.
    """
    message = str(error["msg"])
    value = error.get("input")
    if error.get("type") in _UNECHOED_TYPES or "input" not in error:
        return message
    if value is None:
        return f"{message}, got an empty value (null)"
    if not isinstance(value, str | int | float | bool):
        return message
    shown = repr(value)
    if len(shown) > _ECHO_LIMIT:
        shown = shown[: _ECHO_LIMIT - 3] + "..."
    return f"{message}, got {shown}"


class ConfigError(MsquantInputError):
    """A YAML spec (or a spec built from Python objects) is invalid; carries every issue found."""

    def __init__(self, issues: Sequence[ConfigIssue], source: str | None = None) -> None:
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        self.source = source
        where = f" in {source}" if source else ""
        count = len(self.issues)
        lines = [f"invalid quantization config{where} ({count} error{'s' if count != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))


class ModelLoadError(MsquantInputError):
    """The model directory is missing, incomplete, unsupported or not loadable safely."""


class CalibrationDataError(MsquantInputError):
    """The calibration file is missing, unreadable, malformed or empty."""


class DeviceError(MsquantInputError):
    """A device string is malformed or names a device that is not present."""


class OutputPathError(MsquantInputError):
    """The save path cannot be used (it is a file, not writable, or holds unrelated files)."""


class QuantizationError(MsquantInputError):
    """A layer cannot be quantized as configured (shape, divisibility, non-finite values, ...)."""


class NotImplementedYetError(MsquantInputError):
    """The config is valid but asks for something this version of msquant does not implement yet."""


class RegistryError(MsquantError):
    """A processor registration is inconsistent (duplicate name, bad plugin entry point)."""


class TransformCheckError(QuantizationError):
    """A transform that must keep the model's function (a smoothing fold, a rotation) would not:
    its data flow does not hold on this model, or the layer computes something else after it."""


class PluginError(RegistryError, MsquantInputError):
    """A run asks for a name whose plugin was set aside: it failed to import, names the wrong
    kind of object, or claims a name another plugin claims too (exit 2 from the CLI). The message
    names the distribution and the entry point; ``problem`` holds them
    (:class:`msquant.registry_base.PluginProblem`)."""

    def __init__(self, problem: PluginProblem) -> None:
        self.problem = problem
        super().__init__(problem.message())
