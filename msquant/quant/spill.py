"""Read several name -> quantized weight mappings as one.

A streamed run returns each decoder layer to the meta device once its export is written; the
quantized weights of released layers are then read back from disk (:class:`msquant.run.checkpoint.store.LayerStore`,
the run's checkpoint store or a scratch one), those still in memory (the head) from the model.
:class:`MergedWeights` gives the read-back check of the exports one mapping over both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from msquant.quant.quantized_weight import QuantizedWeight

__all__ = ["MergedWeights"]


class MergedWeights(Mapping[str, QuantizedWeight]):
    """Several name -> weight mappings read as one (the first that holds a name wins)."""

    def __init__(self, *parts: Mapping[str, QuantizedWeight]) -> None:
        self.parts = parts

    def __getitem__(self, name: str) -> QuantizedWeight:
        for part in self.parts:
            if name in part:
                return part[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name for part in self.parts for name in part))

    def __len__(self) -> int:
        return sum(1 for _ in self)
