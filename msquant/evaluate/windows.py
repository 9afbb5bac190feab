"""Perplexity of a loaded model on a token stream, over sliding windows.

The token stream is cut into windows of ``seqlen`` tokens starting every ``stride`` tokens (default:
``stride = seqlen``, non-overlapping). Each token is scored once, by the window where it first
appears after the window's first token (the Hugging Face sliding-window recipe): a window
overlapping the previous one scores only its new tokens, using the overlap as context. The
perplexity is ``exp(total NLL / scored tokens)``, the NLL summed in float64 over natural-log token
probabilities.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from msquant.evaluate.errors import EvaluationError

__all__ = [
    "DEFAULT_SEQLEN",
    "PROGRESS_STEPS",
    "Window",
    "sliding_windows",
    "sliding_window_perplexity",
    "PerplexityMeasurement",
    "measure_perplexity",
]

logger = logging.getLogger(__name__)


DEFAULT_SEQLEN = 512

PROGRESS_STEPS = 10  # log lines per evaluation


@dataclass(frozen=True)
class Window:
    """One evaluation window: tokens ``[begin, end)`` run through the model, tokens
    ``[score_from, end)`` scored (each predicted from the tokens before it in the window)."""

    begin: int
    end: int
    score_from: int

    @property
    def scored(self) -> int:
        """How many tokens this window scores."""
        return self.end - self.score_from


def sliding_windows(
    total: int, seqlen: int, stride: int | None = None, max_samples: int | None = None
) -> list[Window]:
    """The windows over ``total`` tokens; each token is scored at most once.

    Window ``k`` runs tokens ``[k*stride, min(k*stride + seqlen, total))`` and scores those not
    scored before, never its own first token (it has no context in the window): with overlapping
    windows every token but the very first is scored, with non-overlapping ones every token but
    each window's first. The last window ends at ``total``; windows scoring nothing are skipped.

    :param stride: default ``seqlen`` (non-overlapping); must be in ``[1, seqlen]``.
    :param max_samples: keep at most this many windows (the first ones).
    :raises EvaluationError: for settings out of range.
    """
    stride = seqlen if stride is None else stride
    if seqlen < 2:
        raise EvaluationError(f"seqlen must be at least 2 tokens, got {seqlen}")
    if not 1 <= stride <= seqlen:
        raise EvaluationError(
            f"stride must be between 1 and seqlen ({seqlen}), got {stride}: a stride longer than "
            "the window would leave tokens unscored"
        )
    if max_samples is not None and max_samples < 1:
        raise EvaluationError(f"max_samples must be a positive integer, got {max_samples}")
    windows: list[Window] = []
    scored_until, begin = 0, 0
    while max_samples is None or len(windows) < max_samples:
        end = min(begin + seqlen, total)
        window = Window(begin, end, max(scored_until, begin + 1))
        if window.scored > 0:
            windows.append(window)
        scored_until = end
        if end >= total:
            break
        begin += stride
    return windows


@torch.inference_mode()
def sliding_window_perplexity(
    model: nn.Module,
    input_ids: torch.Tensor,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
) -> tuple[float, int, int]:
    """Total NLL (float64 sum, natural log), scored tokens and windows of ``model`` on a token
    stream, one window per forward pass, on the model's device.

    :param input_ids: 1-D int64 token ids.
    :raises EvaluationError: when the windows score no token (fewer than 2 tokens).
    """
    ids = input_ids.reshape(-1).to(torch.long)
    windows = sliding_windows(int(ids.numel()), seqlen, stride, max_samples)
    if not windows:
        raise EvaluationError(
            f"the text has {ids.numel()} token(s): at least 2 are needed to score one"
        )
    device = next(model.parameters()).device
    model.eval()
    total_nll = torch.zeros((), dtype=torch.float64)
    every = max(1, len(windows) // PROGRESS_STEPS)
    started = time.perf_counter()
    for index, window in enumerate(windows):
        chunk = ids[window.begin : window.end].unsqueeze(0).to(device)
        logits = model(input_ids=chunk, use_cache=False).logits[0]
        # Position p predicts token p + 1: the scored tokens are predicted by the rows before them.
        first = window.score_from - window.begin - 1
        rows = logits[first : window.end - window.begin - 1].float()
        targets = ids[window.score_from : window.end].to(rows.device)
        log_probs = torch.log_softmax(rows, dim=-1).gather(1, targets.unsqueeze(1))
        total_nll -= log_probs.double().sum().cpu()
        if (index + 1) % every == 0 or index + 1 == len(windows):
            logger.info(
                "window %d/%d (tokens %d..%d), %.1f s",
                index + 1,
                len(windows),
                window.begin,
                window.end,
                time.perf_counter() - started,
            )
    scored = sum(window.scored for window in windows)
    return float(total_nll), scored, len(windows)


@dataclass(frozen=True)
class PerplexityMeasurement:
    """What :func:`measure_perplexity` found on a token stream.

    :param nll: mean negative log-likelihood per scored token (natural log).
    :param tokens: scored tokens.
    :param windows: windows evaluated.
    :param text_tokens: tokens in the whole stream.
    :param seconds: time of the forward passes.
    """

    nll: float
    tokens: int
    windows: int
    text_tokens: int
    seconds: float

    @property
    def ppl(self) -> float:
        """``exp(nll)``."""
        return math.exp(self.nll)


def measure_perplexity(
    model: nn.Module,
    input_ids: torch.Tensor,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
) -> PerplexityMeasurement:
    """The perplexity of an already loaded ``model`` (on its device) on a token stream: the core
    shared by ``msquant eval`` and the evaluation at the end of a quantization run.

    :raises EvaluationError: for window settings out of range or fewer than 2 tokens.
    """
    started = time.perf_counter()
    nll, tokens, windows = sliding_window_perplexity(model, input_ids, seqlen, stride, max_samples)
    return PerplexityMeasurement(
        nll=nll / tokens,
        tokens=tokens,
        windows=windows,
        text_tokens=int(input_ids.numel()),
        seconds=time.perf_counter() - started,
    )
