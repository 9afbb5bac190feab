"""What the report page shows, read from a report document: its modules (each placed in its decoder
layer) and layers, and a color per module type. Missing or malformed fields are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msquant.report.document import mapping_entries
from msquant.report.html.text import finite_number

__all__ = [
    "TYPE_COLORS",
    "EXTRA_COLORS",
    "OTHER_LAYER",
    "PageModule",
    "PageLayer",
    "page_layers",
    "LAYER_INDEX",
    "page_modules",
    "type_colors",
]


#: Colors of the usual decoder linear layers; other module types get one of ``EXTRA_COLORS``.
TYPE_COLORS = {
    "q_proj": "#4e79a7",
    "k_proj": "#76b7b2",
    "v_proj": "#59a14f",
    "o_proj": "#edc948",
    "gate_proj": "#b07aa1",
    "up_proj": "#ff9da7",
    "down_proj": "#e15759",
}
EXTRA_COLORS = ("#9c755f", "#f28e2b", "#bab0ac", "#8cd17d", "#86bcb6", "#d37295")
OTHER_LAYER = "other"  # group of modules outside every decoder layer (e.g. lm_head)


@dataclass(frozen=True)
class PageModule:
    """One module row as the page shows it (values already validated)."""

    name: str
    layer: int | None  # decoder layer index; None outside every layer
    type: str  # last component of the name: q_proj, down_proj, ...
    entry: Mapping[str, Any]

    def number(self, key: str) -> float | None:
        """A finite numeric field, else None."""
        return finite_number(self.entry.get(key))

    @property
    def ratio(self) -> float | None:
        """``output_error / rtn_output_error`` (below 1: GPTQ did better than rounding)."""
        error, rtn = self.number("output_error"), self.number("rtn_output_error")
        if error is None or rtn is None or rtn <= 0:
            return None
        return error / rtn


@dataclass(frozen=True)
class PageLayer:
    """One decoder layer as the page shows it: index, name and wall time."""

    index: int
    name: str
    seconds: float | None


def page_layers(report: Mapping[str, Any]) -> list[PageLayer]:
    """The report's decoder layers with a valid index and name."""
    layers = []
    for entry in mapping_entries(report.get("layers")):
        index, name = entry.get("index"), entry.get("name")
        if isinstance(index, int) and not isinstance(index, bool) and isinstance(name, str):
            layers.append(PageLayer(index, name, finite_number(entry.get("seconds"))))
    return layers


LAYER_INDEX = re.compile(r"\.(\d+)\.")


def page_modules(report: Mapping[str, Any], layers: Sequence[PageLayer]) -> list[PageModule]:
    """The modules, each placed in the decoder layer whose name prefixes it (or by the first
    ``.N.`` in its name when the report lists no layers)."""
    prefixes = sorted(
        ((layer.name + ".", layer.index) for layer in layers), key=lambda p: -len(p[0])
    )
    modules = []
    for entry in mapping_entries(report.get("modules")):
        name = entry.get("name")
        if not isinstance(name, str):
            continue
        layer = next((index for prefix, index in prefixes if name.startswith(prefix)), None)
        if layer is None and not layers:
            match = LAYER_INDEX.search(name)
            layer = int(match.group(1)) if match else None
        modules.append(PageModule(name, layer, name.rpartition(".")[2], entry))
    return modules


def type_colors(modules: Sequence[PageModule]) -> dict[str, str]:
    """A color per module type: fixed for the usual ones, then the extra palette in order."""
    colors: dict[str, str] = {}
    extra = 0
    for module in modules:
        if module.type in colors:
            continue
        if module.type in TYPE_COLORS:
            colors[module.type] = TYPE_COLORS[module.type]
        else:
            colors[module.type] = EXTRA_COLORS[extra % len(EXTRA_COLORS)]
            extra += 1
    return colors
