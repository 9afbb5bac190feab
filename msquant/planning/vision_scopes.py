"""Quantizing entries whose scopes reach a vision-language model's vision tower or projector.

msModelSlim walks those parts and quantizes the linear layers its ``include`` / ``exclude``
select there, calibrating them with images. msquant quantizes the text decoder, calibrated on
text (:mod:`msquant.model.vision`), so an entry that selects such a layer would export something
other than what the config asks for: the run is refused, naming the layers and the ``exclude``
pattern that keeps them float.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from msquant.model.layers import DecoderLayer
from msquant.model.vision import vision_parts
from msquant.planning.model import ModulePlanner, entry_path

__all__ = ["vision_scope_errors"]

#: Layers named in a message before "and N more".
LISTED = 4


def vision_scope_errors(
    planners: Sequence[tuple[int, ModulePlanner]], model: nn.Module, head: str | None
) -> list[str]:
    """One error per quantizing entry that selects a linear layer of the vision tower or
    projector (none for a text-only model)."""
    parts = vision_parts(model, head)
    if not parts:
        return []
    views = [DecoderLayer(-1, name, module) for name, module in parts]
    errors = []
    for index, planner in planners:
        decisions = planner.plan_modules(model, views)
        prefixes = tuple(f"{name}." for name, _ in parts)
        selected = [
            name
            for name, decision in decisions.items()
            if name.startswith(prefixes)
            and decision.scheme is not None
            and not decision.scheme.skipped
        ]
        if not selected:
            continue
        listed = ", ".join(selected[:LISTED])
        more = f" and {len(selected) - LISTED} more" if len(selected) > LISTED else ""
        patterns = ", ".join(repr(f"{name}.*") for name, _ in parts)
        errors.append(
            f"{entry_path(index)} selects {len(selected)} linear layer(s) outside the text "
            f"decoder of this vision-language model: {listed}{more}. msModelSlim quantizes "
            "them, calibrated with images through the vision tower; msquant quantizes the text "
            "decoder only, calibrated on text, and exports the vision tower and projector "
            f"unchanged. Add exclude patterns for them to keep them float ({patterns})"
        )
    return errors
