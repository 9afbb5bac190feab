"""The result of verifying an export: per-layer entries, errors, consumer notes.

Errors are consistency failures (the files contradict themselves or the format's specification);
warnings are consumer-rule notes (the export is valid but a named serving engine refuses or
restricts it). ``ok`` is true when there is no error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from msquant.verify.forward import ForwardCheck

__all__ = ["LayerReport", "VerifyReport", "Findings", "render_table"]

# How many layer names a grouped consumer note lists before "and N more".
MAX_NAMED_LAYERS = 6


@dataclass
class LayerReport:
    """What verification found for one quantized layer.

    :param name: module name (``model.layers.0.self_attn.q_proj``).
    :param scheme: the format's own name for the layer's scheme (``W8A16``, ``gptq``, ``group_0``).
    :param bits: bit width of the codes.
    :param group_size: group width over input columns, ``None`` per-channel.
    :param symmetric: whether every zero point is the symmetric one.
    :param relative_error: ``||W - W_hat||_F / ||W||_F`` against the original model, when given.
    :param error_bound: the bound ``relative_error`` was held to.
    :param max_code_mismatch: largest ``|code - reference code|``, when a reference was given.
    :param value_type: what the codes are (``int8``, ``mxfp8``), once the layer was decoded.
    """

    name: str
    scheme: str
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    relative_error: float | None = None
    error_bound: float | None = None
    max_code_mismatch: int | None = None
    value_type: str | None = None


@dataclass
class VerifyReport:
    """Everything :func:`msquant.verify_export` found in one export folder."""

    format: str
    path: Path
    layers: list[LayerReport] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: the logits comparison with the original model (``--model_path``), when it ran
    forward: ForwardCheck | None = None

    @property
    def ok(self) -> bool:
        """True when no consistency error was found (warnings do not count)."""
        return not self.errors

    def layer(self, name: str) -> LayerReport:
        """The entry of one layer (``KeyError`` when the layer was not found)."""
        for entry in self.layers:
            if entry.name == name:
                return entry
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable view (``msquant verify --json`` prints it)."""
        return {
            "format": self.format,
            "path": str(self.path),
            "ok": self.ok,
            "layers": [asdict(entry) for entry in self.layers],
            "errors": list(self.errors),
            "warnings": list(self.warnings),
            "forward": asdict(self.forward) if self.forward is not None else None,
        }


class Findings:
    """Collects errors and consumer notes while an export is read.

    Consumer notes that apply to many layers (e.g. "vLLM refuses asymmetric GPTQ") are grouped:
    :meth:`note` records a layer under a message, and :meth:`grouped_warnings` emits one warning
    per message naming the layers.
    """

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self._notes: dict[str, list[str]] = {}

    def error(self, message: str) -> None:
        """Record a consistency error (the message names the offending tensor or file)."""
        self.errors.append(message)

    def warn(self, message: str) -> None:
        """Record a consumer-rule note that is not a failure."""
        if message not in self.warnings:
            self.warnings.append(message)

    def note(self, message: str, layer: str) -> None:
        """Record that ``layer`` falls under the consumer note ``message``."""
        self._notes.setdefault(message, []).append(layer)

    def grouped_warnings(self) -> list[str]:
        """The grouped notes as warnings: ``message (N layers: a, b, ...)``."""
        return [f"{message} ({_name_layers(layers)})" for message, layers in self._notes.items()]


def _name_layers(layers: list[str]) -> str:
    count = len(layers)
    shown = ", ".join(layers[:MAX_NAMED_LAYERS])
    more = f", and {count - MAX_NAMED_LAYERS} more" if count > MAX_NAMED_LAYERS else ""
    return f"{count} layer{'s' if count != 1 else ''}: {shown}{more}"


def _cell(value: object, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "sym" if value else "asym"
    if isinstance(value, float):
        return f"{value:.{digits}e}"
    return str(value)


def render_table(report: VerifyReport) -> str:
    """A plain-text table of the layers followed by the errors and warnings (for the CLI)."""
    header = ("layer", "scheme", "bits", "group", "sym", "rel. error", "bound", "code diff")
    rows: list[tuple[str, ...]] = [header]
    for entry in report.layers:
        group = (
            "channel" if entry.group_size is None and entry.bits is not None else entry.group_size
        )
        rows.append(
            (
                entry.name,
                entry.scheme,
                _cell(entry.bits),
                _cell(group),
                _cell(entry.symmetric),
                _cell(entry.relative_error),
                _cell(entry.error_bound, 2),
                _cell(entry.max_code_mismatch),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"{report.format} export: {report.path}"]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if report.forward is not None:
        check = report.forward
        lines.append(
            f"forward check ({check.tokens} tokens, {check.seconds:.1f} s): relative logits error "
            f"{check.relative_error:.3g} (bound {check.bound:.3g} for {check.scheme}; rounded to "
            f"nearest: {check.rounded_error:.3g}), top-1 "
            f"agreement {check.top1_agreement:.0%}"
        )
    lines += _section("error", report.errors)
    lines += _section("warning", report.warnings)
    status = "OK" if report.ok else "FAILED"
    lines.append(
        f"{status}: {len(report.layers)} quantized layer(s), {len(report.errors)} error(s), "
        f"{len(report.warnings)} warning(s)"
    )
    return "\n".join(lines)


def _section(kind: str, messages: Iterable[str]) -> list[str]:
    items = list(messages)
    if not items:
        return []
    return [f"{len(items)} {kind}(s):"] + [f"  - {message}" for message in items]
