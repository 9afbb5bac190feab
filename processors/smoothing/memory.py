"""What a smoothing processor holds while the run works on one decoder layer, for the memory
estimate of ``--max_memory`` (:meth:`msquant.plugin.Processor.memory_bytes`).

During its calibration pass a smoothing processor keeps, per smoothed subgraph, the
per-channel maximum of the first linear's input and, for ``flex_smooth_quant``'s alpha/beta
search, every input row of it (:class:`~msquant.processors.smoothing.statistics.InputStatistics`:
each calibration token's row, in the activations' dtype; the search later takes at most
:data:`~msquant.processors.smoothing.folding.MAX_SEARCH_TOKENS` of them). Folding a subgraph then
makes working copies: the search's buffers (the rows it searches on twice, the subgraph's weight
twice, the float and the int8 product of the two, the screen's copies of the larger operand and
of the float product dealt into row blocks, and the int8 codes of the whole smaller operand for
each candidate of a sweep) or one ``|W|`` of a weight for its column maxima.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from msquant.plugin import CalibrationSize
from msquant.plugin.model import SmoothingSubgraph
from msquant.processors.smoothing.folding import MAX_SEARCH_TOKENS

#: The candidates of one sweep of the alpha / beta search (0, 0.05, ..., 1), whose int8 codes the
#: screen may hold at once (``msquant.quant.smoothing.SmoothingSearch``).
SCREEN_CANDIDATES = 21

__all__ = ["smoothing_memory"]


def _linear(model: nn.Module, name: str) -> nn.Linear:
    module = model.get_submodule(name)
    assert isinstance(module, nn.Linear)
    return module


def smoothing_memory(
    model: nn.Module,
    subgraphs: Sequence[SmoothingSubgraph],
    calibration: CalibrationSize,
    search: bool,
) -> dict[str, int]:
    """The items of the module docstring for one layer's smoothed ``subgraphs``.

    :param search: alpha and beta are searched (the input rows are kept).
    """
    if not subgraphs:
        return {}
    value = calibration.dtype_bytes
    widths = [_linear(model, s.targets[0]).in_features for s in subgraphs]
    items = {"channel maxima": sum(widths) * value}
    if search:
        items["search rows (every calibration token)"] = calibration.tokens * sum(widths) * value
    rows = min(calibration.tokens, MAX_SEARCH_TOKENS)
    working = 0
    for subgraph, width in zip(subgraphs, widths, strict=True):
        targets = [_linear(model, name) for name in subgraph.targets]
        weight_bytes = targets[0].weight.element_size()
        largest = max(t.out_features * t.in_features for t in targets) * weight_bytes
        working = max(working, largest)  # |W| for the column maxima
        if search:
            out_features = sum(t.out_features for t in targets)
            searched = (
                2 * rows * width * value
                + 2 * out_features * width * weight_bytes
                + 3 * rows * out_features * weight_bytes
                + max(rows, out_features) * width * weight_bytes
                + SCREEN_CANDIDATES * min(rows, out_features) * width
            )
            working = max(working, searched)
    label = "alpha/beta search (largest subgraph)" if search else "fold (largest subgraph)"
    items[label] = working
    return items
