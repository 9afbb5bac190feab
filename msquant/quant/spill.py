"""Quantized weights kept on disk instead of in memory, for checks that run after the export.

A streamed run returns each decoder layer to the meta device once its export is written, so the
quantized weights are no longer in memory when the export is read back and compared with them.
:class:`QuantizedWeightSpill` keeps them in a scratch folder instead (one safetensors file per
layer) and reads each one back on demand: it is a read-only mapping ``module name ->``
:class:`~msquant.QuantizedWeight`, like the in-memory reference of a whole-model run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from msquant.quant.quantized_linear import QuantizedLinear
from msquant.quant.quantized_weight import QuantizedWeight

__all__ = ["QuantizedWeightSpill", "MergedWeights"]

_PARTS = ("codes", "scale", "offset")


@dataclass(frozen=True)
class _Entry:
    file: Path
    bits: int
    symmetric: bool
    group_size: int | None


class QuantizedWeightSpill(Mapping[str, QuantizedWeight]):
    """Quantized weights written to ``directory`` module tree by module tree, read back lazily.

    :param directory: an existing scratch folder owned by the caller (removed by it afterwards).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._entries: dict[str, _Entry] = {}
        self._files = 0

    def add_modules(self, root: nn.Module, prefix: str) -> int:
        """Write every :class:`QuantizedLinear` under ``root`` (full names under ``prefix``);
        returns how many were written."""
        tensors = {}
        entries = {}
        self._files += 1
        file = self.directory / f"part-{self._files:05d}.safetensors"
        for name, module in root.named_modules(prefix=prefix):
            if not isinstance(module, QuantizedLinear) or name in self._entries:
                continue
            qweight = module.qweight
            for part in _PARTS:
                tensors[f"{name}.{part}"] = getattr(qweight, part).detach().to("cpu").contiguous()
            entries[name] = _Entry(file, qweight.bits, qweight.symmetric, qweight.group_size)
        if tensors:
            save_file(tensors, str(file), metadata={"modules": json.dumps(sorted(entries))})
            self._entries.update(entries)
        return len(entries)

    def __getitem__(self, name: str) -> QuantizedWeight:
        entry = self._entries[name]
        with safe_open(str(entry.file), framework="pt") as handle:
            codes, scale, offset = (handle.get_tensor(f"{name}.{part}") for part in _PARTS)
        return QuantizedWeight(codes, scale, offset, entry.bits, entry.symmetric, entry.group_size)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


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
