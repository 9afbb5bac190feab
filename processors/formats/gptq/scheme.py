"""The per-module scheme a GPTQ checkpoint expresses (shared by the packer, the config writer and
the consumer checks of the GPTQ saver), and the error every GPTQ step raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from msquant.plugin import QuantizationError, QuantizedLinear

__all__ = [
    "CheckpointFormat",
    "CheckpointFormatChoice",
    "VLLM_BITS",
    "GPTQScheme",
    "MaybeScheme",
    "LinearLike",
    "gptq_error",
    "listing",
]

CheckpointFormat = Literal["gptq", "gptq_v2"]
CheckpointFormatChoice = Literal["auto", "gptq", "gptq_v2"]

#: (bits, sym) pairs vLLM 0.33 / 0.34 / SGLang serve from a GPTQ checkpoint (``uint4b8``, ``uint8b128``).
VLLM_BITS = (4, 8)


@dataclass(frozen=True)
class GPTQScheme:
    """The per-module settings a GPTQ ``quantization_config`` expresses.

    ``group_size`` is -1 for per-channel weights, as GPTQ writes it.
    """

    bits: int
    group_size: int
    sym: bool

    @classmethod
    def of(cls, module: QuantizedLinear) -> GPTQScheme:
        """The scheme of a quantized linear layer."""
        group_size = -1 if module.group_size is None else module.group_size
        return cls(module.bits, group_size, module.symmetric)

    def describe(self) -> str:
        """Human-readable form, e.g. ``int4 group 32 sym``."""
        scope = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"int{self.bits} {scope} {'sym' if self.sym else 'asym'}"

    def as_config(self) -> dict[str, Any]:
        """The ``bits`` / ``group_size`` / ``sym`` keys of a ``quantization_config``."""
        return {"bits": self.bits, "group_size": self.group_size, "sym": self.sym}

    def overrides(self, base: GPTQScheme) -> dict[str, Any]:
        """The keys of a positive ``dynamic`` rule: only those that differ from ``base``."""
        mine, theirs = self.as_config(), base.as_config()
        return {key: value for key, value in mine.items() if theirs[key] != value}

    @property
    def vllm_servable(self) -> bool:
        """Whether vLLM 0.33 / 0.34 / SGLang have a GPTQ kernel for it (4/8-bit symmetric)."""
        return self.sym and self.bits in VLLM_BITS


#: A linear layer's scheme, or ``None`` for a linear layer left in float.
MaybeScheme = GPTQScheme | None
#: A linear layer of a decoder layer, before or after quantization.
LinearLike = nn.Linear | QuantizedLinear


def gptq_error(name: str, message: str) -> QuantizationError:
    """The error of a GPTQ export step about module (or module group) ``name``."""
    return QuantizationError(f"gptq_saver: {name}: {message}")


#: How many offending modules a message lists before "and N more".
LISTED_MODULES = 6


def listing(names: list[str]) -> str:
    """``a, b, c, d, e, f and N more``."""
    shown = ", ".join(names[:LISTED_MODULES])
    more = len(names) - LISTED_MODULES
    return f"{shown} and {more} more" if more > 0 else shown
