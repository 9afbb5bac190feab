"""What ``msquant eval`` reports: the perplexity of one model, or of an original and its export."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PerplexityResult", "PerplexityComparison"]


@dataclass(frozen=True)
class PerplexityResult:
    """The perplexity of one model on one text file.

    :param model: the evaluated folder.
    :param kind: ``float`` or the export format (``ascend``, ``mindie``, ``gptq``,
        ``compressed-tensors``).
    :param data: the text file.
    :param ppl: ``exp(nll)``.
    :param nll: mean negative log-likelihood per scored token (natural log).
    :param tokens: scored tokens.
    :param windows: windows evaluated.
    :param text_tokens: tokens in the whole text (more than covered when ``max_samples`` cut it).
    :param seqlen: window length.
    :param stride: distance between window starts.
    :param dtype: the model dtype the forward passes ran in.
    :param seconds: time of the forward passes.
    :param load_seconds: time to load (and for exports dequantize) the model.
    """

    model: str
    kind: str
    data: str
    ppl: float
    nll: float
    tokens: int
    windows: int
    text_tokens: int
    seqlen: int
    stride: int
    dtype: str
    seconds: float
    load_seconds: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable view."""
        return asdict(self)

    def summary(self) -> str:
        """One readable line."""
        return (
            f"perplexity {self.ppl:.4f} (nll {self.nll:.5f}, {self.tokens} tokens in "
            f"{self.windows} window(s) of {self.seqlen}, stride {self.stride}, {self.dtype}) "
            f"of {self.model} [{self.kind}] on {self.data} in {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class PerplexityComparison:
    """Perplexities of an original model and its quantized export on the same tokens."""

    original: PerplexityResult
    quantized: PerplexityResult

    @property
    def relative_increase(self) -> float:
        """``quantized.ppl / original.ppl - 1`` (0.01 means +1 %)."""
        return self.quantized.ppl / self.original.ppl - 1.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable view."""
        return {
            "original": self.original.to_dict(),
            "quantized": self.quantized.to_dict(),
            "relative_increase": self.relative_increase,
            "relative_increase_percent": 100.0 * self.relative_increase,
        }

    def summary(self) -> str:
        """Readable lines: both perplexities and the relative increase."""
        width = max(len(self.original.model), len(self.quantized.model))
        lines = [
            f"original   {self.original.model:<{width}}  [{self.original.kind}]  "
            f"ppl {self.original.ppl:.4f}",
            f"quantized  {self.quantized.model:<{width}}  [{self.quantized.kind}]  "
            f"ppl {self.quantized.ppl:.4f}",
            f"relative increase {100.0 * self.relative_increase:+.3f} % "
            f"({self.original.tokens} tokens in {self.original.windows} window(s) of "
            f"{self.original.seqlen}, stride {self.original.stride}, on {self.original.data})",
        ]
        return "\n".join(lines)
