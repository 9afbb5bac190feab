"""Plan-time refusal of activation schemes a run's savers cannot store, naming the savers that can.

A saver declares what it stores with ``writes_activations`` and ``activation_schemes``
(:class:`msquant.Saver`); the savers named in the message are the installed ones
(:func:`msquant.contracts.registry.default_registry`), so the engine names no format itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from msquant.planning.model import PlanRow

if TYPE_CHECKING:
    from msquant.contracts.processor import Processor

__all__ = ["activation_errors", "savers_storing"]


def _stores(processor: object, scheme: str) -> bool:
    """Whether a saver (class or instance) stores layers with activation scheme ``scheme``."""
    check = getattr(processor, "stores_activation_scheme", None)
    if callable(check):
        return bool(check(scheme))
    return bool(getattr(processor, "writes_activations", False))


def savers_storing(scheme: str) -> list[str]:
    """The installed savers (``type`` names, sorted) that store activation scheme ``scheme``."""
    from msquant.contracts.registry import default_registry

    registry = default_registry()
    return sorted(name for name in registry.names("save") if _stores(registry.get(name), scheme))


def activation_errors(processors: Sequence[Processor], rows: Sequence[PlanRow]) -> list[str]:
    """One error per saver of the run that cannot store an activation scheme the plan uses."""
    by_scheme: dict[str, list[str]] = {}
    for row in rows:
        if row.act is not None and not row.skipped:
            by_scheme.setdefault(row.act, []).append(row.module)
    errors = []
    for processor in processors:
        if processor.stage != "save":
            continue
        for scheme, modules in by_scheme.items():
            if _stores(processor, scheme):
                continue
            able = savers_storing(scheme)
            where = (
                f"savers that store it: {', '.join(able)}"
                if able
                else "no installed saver stores it"
            )
            errors.append(
                f"{processor.type_name} does not store activation scheme {scheme}, which "
                f"{len(modules)} layer(s) have ({modules[0]}, ...); {where} "
                "(docs/ascend-format.md, docs/formats.md), or use float activations (omit "
                "qconfig.act)"
            )
    return errors
