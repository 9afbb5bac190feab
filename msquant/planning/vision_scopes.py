"""Quantizing entries whose scopes reach a vision-language model's vision tower or projector.

msModelSlim walks those parts and quantizes the linear layers its ``include`` / ``exclude``
select there, calibrating them with images. A run calibrated on text quantizes such a layer only when its
scheme needs no calibration data (:attr:`~msquant.planning.model.ModuleDecision.data_free`: a
data-free weight method, float or dynamic per-token activations), in a data-free stage of the run
(:mod:`msquant.run.vision_stage`); a run calibrated on images (msModelSlim's image folders,
:mod:`msquant.load.image_calibration`) also quantizes it with static activations and a data-free
weight method (:attr:`~msquant.planning.model.ModuleDecision.static_act_only`: W8A8), its ranges
calibrated on the images' vision-tower forward. An entry that selects one there with a scheme
the run cannot calibrate is refused, naming the layers and the ``exclude`` pattern that keeps
them float.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from msquant.model.layers import DecoderLayer
from msquant.model.vision import vision_parts
from msquant.planning.model import ModuleDecision, ModulePlanner, entry_path

__all__ = ["vision_scope_errors", "vision_selections"]

#: Layers named in a message before "and N more".
LISTED = 4


def vision_selections(
    planners: Sequence[tuple[int, ModulePlanner]], model: nn.Module, head: str | None
) -> list[tuple[int, dict[str, ModuleDecision]]]:
    """Per quantizing entry that selects linear layers of the vision tower or projector, those
    layers' decisions (skipped ones left out); empty for a text-only model."""
    parts = vision_parts(model, head)
    if not parts:
        return []
    views = [DecoderLayer(-1, name, module) for name, module in parts]
    prefixes = tuple(f"{name}." for name, _ in parts)
    found = []
    for index, planner in planners:
        selected = {
            name: decision
            for name, decision in planner.plan_modules(model, views).items()
            if name.startswith(prefixes)
            and decision.scheme is not None
            and not decision.scheme.skipped
        }
        if selected:
            found.append((index, selected))
    return found


def vision_scope_errors(
    planners: Sequence[tuple[int, ModulePlanner]],
    model: nn.Module,
    head: str | None,
    images: bool = False,
) -> list[str]:
    """One error per quantizing entry that selects a linear layer of the vision tower or
    projector with a scheme that needs calibration data the run does not give it (none for a
    text-only model). ``images``: the run calibrates on images, which calibrate static
    activation ranges there (not a calibrated weight method)."""
    parts = vision_parts(model, head)
    errors = []
    for index, decisions in vision_selections(planners, model, head):
        selected = [
            name
            for name, decision in decisions.items()
            if not (decision.data_free or (images and decision.static_act_only))
        ]
        if not selected:
            continue
        listed = ", ".join(selected[:LISTED])
        more = f" and {len(selected) - LISTED} more" if len(selected) > LISTED else ""
        patterns = ", ".join(repr(f"{name}.*") for name, _ in parts)
        errors.append(
            f"{entry_path(index)} selects {len(selected)} linear layer(s) outside the text "
            f"decoder of this vision-language model with a scheme that needs calibration data "
            f"(static activations or a calibrated method): {listed}{more}. msModelSlim "
            "calibrates them with images through the vision tower; msquant does too for static "
            "activations with a data-free weight method (W8A8) when spec.dataset names a folder "
            "of images (msModelSlim's calibImages) and the model folder holds its processor, and "
            "otherwise quantizes vision-tower and projector linears only with data-free schemes "
            "(a weight method that reads no data, activations float or dynamic per_token). Add "
            "exclude "
            f"patterns for them to keep them float ({patterns}), or give them a data-free scheme"
        )
    return errors
