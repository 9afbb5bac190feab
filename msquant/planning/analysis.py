"""The plan of a model under a run's processors: every entry's decisions combined into one row per
linear layer, with the cross-entry errors and warnings and the reviewers' findings.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from torch import nn

from msquant.model.adapter import ModelAdapter
from msquant.model.adapter_registry import adapter_for
from msquant.model.layers import DecoderLayer
from msquant.planning.activation_formats import activation_errors
from msquant.planning.model import (
    NOT_SELECTED,
    KVCachePlan,
    KVCachePlanner,
    ModelPlan,
    ModuleDecision,
    ModulePlanner,
    PlanReviewer,
    PlanRow,
    entry_path,
    source_of,
)
from msquant.planning.problems import (
    fused_errors,
    nothing_quantized_errors,
    overlap_errors,
    rule_warnings,
    tied_head_errors,
)
from msquant.planning.vision_scopes import vision_scope_errors

if TYPE_CHECKING:
    from msquant.contracts.processor import Processor

__all__ = ["analyse_plan", "check_plan"]

logger = logging.getLogger(__name__)


def _planners(processors: Sequence[Processor]) -> list[tuple[int, ModulePlanner]]:
    """The ``spec.process`` entries that plan modules, with their index in ``spec.process``."""
    found: list[tuple[int, ModulePlanner]] = []
    process = [p for p in processors if p.stage == "process"]
    for index, processor in enumerate(process):
        if isinstance(processor, ModulePlanner):
            found.append((index, processor))
    return found


def _module_names(
    layers: Sequence[DecoderLayer], decisions: Sequence[Mapping[str, ModuleDecision]]
) -> list[str]:
    """Every linear layer of the decoder layers, then any other module an entry considers."""
    names = [name for layer in layers for name, _ in layer.named_linears()]
    known = set(names)
    for entry in decisions:
        for name in entry:
            if name not in known:
                names.append(name)
                known.add(name)
    return names


def _row(
    name: str,
    decided: list[tuple[int, ModuleDecision]],
    selecting: list[tuple[int, ModuleDecision]],
) -> PlanRow:
    """The row of one module: the first selecting entry's scheme, or why it stays in float."""
    if selecting:
        index, decision = selecting[0]
        scheme = decision.scheme
        assert scheme is not None
        if scheme.skipped:
            return PlanRow(
                name, None, None, None, None, None, True, source_of(index, scheme), index
            )
        return PlanRow(
            name,
            scheme.bits,
            -1
            if scheme.group_size is None
            else scheme.group_size,  # the plan's JSON: GPTQModel's -1
            scheme.sym,
            scheme.desc_act,
            decision.method,
            False,
            source_of(index, scheme),
            index,
            decision.act,
            scheme.values.name,
        )
    for index, decision in decided:
        if decision.reason:
            return PlanRow(
                name,
                None,
                None,
                None,
                None,
                None,
                True,
                f"{entry_path(index)} {decision.reason}",
                None,
            )
    return PlanRow(name, None, None, None, None, None, True, NOT_SELECTED, None)


def _kv_caches(
    process: Sequence[Processor], model: nn.Module, layers: Sequence[DecoderLayer]
) -> list[KVCachePlan]:
    """The attentions every KV-cache entry of ``spec.process`` considers, in entry order."""
    return [
        KVCachePlan(module, scheme, entry_path(index))
        for index, processor in enumerate(process)
        if isinstance(processor, KVCachePlanner)
        for module, scheme in processor.plan_kv_caches(model, layers).items()
    ]


def analyse_plan(
    processors: Sequence[Processor],
    model: nn.Module,
    layers: Sequence[DecoderLayer],
    *,
    adapter: ModelAdapter | None = None,
    allow_float_export: bool = False,
    images: bool = False,
) -> ModelPlan:
    """The plan of ``model`` (usually a meta model) under the ``spec.process`` entries, with the
    cross-entry errors and the warnings (the entries' own ``check_model`` errors are not included).

    :param adapter: the model's adapter (default: the installed one for its ``model_type``).
    :param allow_float_export: a plan that quantizes no linear layer is no error (the user asks
        for the float model, transformed by the config's rotations or smoothings if any).
    :param images: the run calibrates on images, which reach a vision-language model's vision
        tower (:func:`msquant.planning.vision_scopes.vision_scope_errors`).
    """
    adapter = adapter if adapter is not None else adapter_for(model)
    planners = _planners(processors)
    decisions = [planner.plan_modules(model, layers) for _, planner in planners]
    names = _module_names(layers, decisions)
    selected_by: dict[str, list[tuple[int, ModuleDecision]]] = {}
    rows = []
    for name in names:
        decided = [
            (index, found[name])
            for (index, _), found in zip(planners, decisions, strict=True)
            if name in found
        ]
        selecting = [(index, d) for index, d in decided if d.scheme is not None]
        if selecting:
            selected_by[name] = selecting
        rows.append(_row(name, decided, selecting))
    groups = adapter.fused_groups(names)
    by_name = {row.module: row for row in rows}
    errors = overlap_errors(selected_by)
    errors += fused_errors([*groups, *adapter.expert_groups(names)], selected_by, by_name, adapter)
    errors += tied_head_errors(model, selected_by, adapter)
    head = adapter.output_head(model)
    errors += vision_scope_errors(planners, model, head[0] if head else None, images)
    process = [p for p in processors if p.stage == "process"]
    planning = {id(planner) for _, planner in planners}
    others = [p for p in process if id(p) not in planning]
    transforms = [p.type_name for p in others if p.transforms_weights]
    # a processor that neither plans nor only transforms weights may quantize on its own
    if len(transforms) == len(others) and not allow_float_export:
        errors += nothing_quantized_errors(rows, len(planners), transforms)
    warnings: list[str] = []
    for (index, planner), found in zip(planners, decisions, strict=True):
        warnings += [f"{entry_path(index)}: {note}" for note in planner.plan_notes(model, layers)]
        selected = [name for name, d in found.items() if d.scheme is not None]
        warnings += rule_warnings(
            index, planner.plan_rules(), selected, groups, adapter, head[0] if head else None
        )
    model_type = str(getattr(getattr(model, "config", None), "model_type", "unknown"))
    result = ModelPlan(rows, errors, warnings, model_type, _kv_caches(process, model, layers))
    result.errors += activation_errors(processors, rows)
    for processor in processors:
        if isinstance(processor, PlanReviewer):
            review = processor.review_plan(result, model)
            result.errors += review.errors
            result.warnings += review.warnings
    return result


def check_plan(
    processors: Sequence[Processor],
    model: nn.Module,
    layers: Sequence[DecoderLayer],
    *,
    adapter: ModelAdapter | None = None,
    allow_float_export: bool = False,
    images: bool = False,
) -> list[str]:
    """The cross-entry problems of a run (logging the warnings): call it on the meta model after
    every processor's ``check_model``, before weights are loaded (``allow_float_export``: as for
    :func:`analyse_plan`, ``images`` too)."""
    result = analyse_plan(
        processors,
        model,
        layers,
        adapter=adapter,
        allow_float_export=allow_float_export,
        images=images,
    )
    for warning in result.warnings:
        logger.warning("%s", warning)
    return result.errors
