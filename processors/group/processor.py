"""``group``: the processors of its ``configs`` act on each decoder layer together.

msModelSlim's ``group`` merges several processors so that one flow of the calibration data
through a layer serves all of them: each child prepares the layer, the calibration samples run
through it once, then each child finishes the layer, in the order of ``configs``. The group
forwards every hook to its children in that order and derives what the runner asks of a processor
from them: it calibrates when a child does, makes as many passes as its most demanding child,
batches the samples unless a calibrating child needs them one at a time, calibrates the next layer
on the processed outputs when a calibrating child asks for that, is resumable when every child is
(its checkpoint state is the list of theirs) and plans, reviews and asks for the output head
through its children.

A child that rewrites the layer from its calibration statistics (``rewrites_layer``: the
smoothing processors) cannot share a group with a child that quantizes modules (a
``ModulePlanner``: ``linear_quant``): msModelSlim 26.1.0 smooths nothing there (its
``linear_quant`` wraps the layer's linears before the forward, so the smoothing statistics are
never gathered and every subgraph is skipped with a warning) and fails when the smoothing comes
second, so the group is refused (:func:`smoothing_beside_quantizer`) rather than smoothed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from msquant.plugin import (
    CalibrationSize,
    DecoderLayer,
    DynamicRule,
    OutputHeadUser,
    Processor,
    ProcessorConfig,
    ResumeError,
    RunContext,
)
from msquant.plugin.planning import (
    ModelPlan,
    ModuleDecision,
    ModulePlanner,
    PlanReview,
    PlanReviewer,
)
from msquant.processors.group.config import GroupConfig
from msquant.processors.group.planning import merged_decisions, merged_notes, merged_rules


class GroupProcessor(Processor):
    """msModelSlim's ``group``: the processors of ``configs`` act on each decoder layer together, in order."""

    type_name = "group"
    config_class = GroupConfig
    stage = "process"
    #: The run's checkpoint policy also asks every child (``msquant`` flattens containers).
    resumable = True
    config: GroupConfig

    def __init__(self, config: ProcessorConfig) -> None:
        super().__init__(config)
        self.children: list[Processor] = []

    def adopt_children(self, children: list[Processor]) -> None:
        """Take the children built from ``configs`` and derive the runner's attributes."""
        self.children = list(children)
        calibrating = [c for c in self.children if c.requires_calibration]
        self.requires_calibration = bool(calibrating)
        self.batch_calibration = all(c.batch_calibration for c in calibrating)
        self.calibrate_on_quantized = any(c.calibrate_on_quantized for c in calibrating)
        # a child that rewrites the layer makes the processors after the group calibrate anew
        self.rewrites_layer = any(c.rewrites_layer for c in calibrating)

    # -- checks and plan ------------------------------------------------------------------

    def check_model(self, model: nn.Module, layers: list[DecoderLayer]) -> list[str]:
        own = [
            f"group configs[{index}]: {message}"
            for index, child in enumerate(self.children)
            for message in child.check_model(model, layers)
        ]
        _, overlaps = merged_decisions(self._planners(), model, layers)
        return smoothing_beside_quantizer(self.children) + own + overlaps

    def _planners(self) -> list[tuple[int, ModulePlanner]]:
        return [(i, c) for i, c in enumerate(self.children) if isinstance(c, ModulePlanner)]

    def plan_modules(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> Mapping[str, ModuleDecision]:
        """The children's decisions as one entry's: the first selecting child decides."""
        decisions, _ = merged_decisions(self._planners(), model, layers)
        return decisions

    def plan_rules(self) -> Sequence[DynamicRule]:
        """Every child's ``dynamic`` rules, in order."""
        return merged_rules(self._planners())

    def plan_notes(self, model: nn.Module, layers: Sequence[DecoderLayer]) -> list[str]:
        """Each child's warnings, prefixed with its ``configs[j]``."""
        return merged_notes(self._planners(), model, layers)

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """The reviews of the children that review plans."""
        review = PlanReview()
        for child in self.children:
            if isinstance(child, PlanReviewer):
                found = child.review_plan(plan, model)
                review.errors += found.errors
                review.warnings += found.warnings
        return review

    def uses_output_head(self, ctx: RunContext) -> bool:
        """Whether a child needs the output head stage."""
        return any(isinstance(c, OutputHeadUser) and c.uses_output_head(ctx) for c in self.children)

    # -- the run --------------------------------------------------------------------------

    def setup(self, ctx: RunContext) -> None:
        for child in self.children:
            child.setup(ctx)

    def before_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        for child in self.children:
            child.before_layer(ctx, layer)

    def calibration_passes(self, layer: DecoderLayer) -> int:
        return max((c.calibration_passes(layer) for c in self.children), default=1)

    def memory_bytes(
        self, model: nn.Module, layer: DecoderLayer, calibration: CalibrationSize
    ) -> dict[str, int]:
        """The children's items, each named ``"configs[j] <child type>: <what>"``: they work on
        the layer together."""
        return {
            f"configs[{index}] {child.type_name}: {what}": size
            for index, child in enumerate(self.children)
            for what, size in child.memory_bytes(model, layer, calibration).items()
        }

    def before_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        for child in self.children:
            child.before_pass(ctx, layer, index)

    def after_pass(self, ctx: RunContext, layer: DecoderLayer, index: int) -> None:
        for child in self.children:
            child.after_pass(ctx, layer, index)

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        for child in self.children:
            child.after_layer(ctx, layer)

    def finalize(self, ctx: RunContext) -> None:
        for child in self.children:
            child.finalize(ctx)

    def resume_state(self, ctx: RunContext) -> dict[str, Any]:
        """The children's states, in order, each with its ``type``."""
        return {
            "children": [{"type": c.type_name, "state": c.resume_state(ctx)} for c in self.children]
        }

    def restore(self, ctx: RunContext, state: dict[str, Any]) -> None:
        """Hand each child its recorded state (the checkpoint must hold this group's children)."""
        recorded = state.get("children", [])
        if [entry.get("type") for entry in recorded] != [c.type_name for c in self.children]:
            raise ResumeError(
                "--resume: the checkpoint's group holds other processors than this run's "
                f"({[e.get('type') for e in recorded]} vs {[c.type_name for c in self.children]})"
            )
        for child, entry in zip(self.children, recorded, strict=True):
            child.restore(ctx, entry["state"])


def _leaves(children: Sequence[Processor], prefix: str = "") -> list[tuple[str, Processor]]:
    """``(configs[i].configs[j]..., processor)`` of every non-container processor in a group."""
    found: list[tuple[str, Processor]] = []
    for index, child in enumerate(children):
        where = f"{prefix}configs[{index}]"
        if isinstance(child, GroupProcessor):
            found += _leaves(child.children, f"{where}.")
        else:
            found.append((where, child))
    return found


def smoothing_beside_quantizer(children: Sequence[Processor]) -> list[str]:
    """The refusal of a group (nested groups flattened) holding both a processor that rewrites
    the layer from its statistics and one that quantizes modules (see the module docstring)."""
    leaves = _leaves(children)
    rewriting = [(w, c) for w, c in leaves if c.rewrites_layer and c.requires_calibration]
    quantizing = [(w, c) for w, c in leaves if isinstance(c, ModulePlanner)]
    if not rewriting or not quantizing:
        return []
    names = ", ".join(f"{w} ({c.type_name})" for w, c in rewriting)
    others = ", ".join(f"{w} ({c.type_name})" for w, c in quantizing)
    return [
        f"group {names} shares the group with {others}: msModelSlim 26.1.0 smooths nothing in "
        "such a group (linear_quant wraps the layer's linears before the calibration forward, "
        "so the smoothing gathers no statistics and skips every subgraph with a warning) and "
        "fails when the smoothing comes after linear_quant; msquant refuses the group instead "
        "of exporting something msModelSlim does not. Put the smoothing entry before the group "
        "in spec.process to smooth (as msModelSlim's best practices do), or delete it for "
        "msModelSlim's export"
    ]
