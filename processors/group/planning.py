"""The plan of a ``group``: its children's decisions merged as if they were one entry.

Within the group the first child that selects a module decides it (its source is named
``configs[j]``, so the plan says ``spec.process[2].configs[1]``); two children selecting the same
module are an error, as two entries of ``spec.process`` are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn

from msquant.plugin import DecoderLayer, DynamicRule
from msquant.plugin.planning import BASE_SOURCE, ModuleDecision, ModulePlanner


def child_source(index: int, decided_by: str) -> str:
    """``configs[1]`` for a child's base qconfig, ``configs[1].dynamic["..."]`` for its rules."""
    return f"configs[{index}]" if decided_by == BASE_SOURCE else f"configs[{index}].{decided_by}"


def merged_decisions(
    planners: Sequence[tuple[int, ModulePlanner]], model: nn.Module, layers: Sequence[DecoderLayer]
) -> tuple[dict[str, ModuleDecision], list[str]]:
    """Per module, the first selecting child's decision (else the first child's reason), and
    the overlap errors (a module selected by two children)."""
    merged: dict[str, ModuleDecision] = {}
    selected_by: dict[str, int] = {}
    errors: list[str] = []
    for index, planner in planners:
        for name, decision in planner.plan_modules(model, layers).items():
            if decision.scheme is None:
                if name not in merged:
                    reason = f"configs[{index}] {decision.reason}" if decision.reason else ""
                    merged[name] = dataclasses.replace(decision, reason=reason)
                continue
            if name in selected_by:
                errors.append(
                    f"group: {name} is selected by configs[{selected_by[name]}] and "
                    f"configs[{index}]; select each module in one entry of the group only"
                )
                continue
            selected_by[name] = index
            scheme = dataclasses.replace(
                decision.scheme, decided_by=child_source(index, decision.scheme.decided_by)
            )
            merged[name] = dataclasses.replace(decision, scheme=scheme)
    return merged, errors


def merged_rules(planners: Sequence[tuple[int, ModulePlanner]]) -> list[DynamicRule]:
    """Every child's ``dynamic`` rules, in order."""
    return [rule for _, planner in planners for rule in planner.plan_rules()]


def merged_notes(
    planners: Sequence[tuple[int, ModulePlanner]], model: nn.Module, layers: Sequence[DecoderLayer]
) -> list[str]:
    """Each child's own warnings, prefixed with ``configs[j]``."""
    return [
        f"configs[{index}]: {note}"
        for index, planner in planners
        for note in planner.plan_notes(model, layers)
    ]
