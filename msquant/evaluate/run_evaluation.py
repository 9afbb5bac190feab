"""The evaluation of a quantization run (``msquant quant --eval_data``): the text file read and
checked before the run starts, the perplexity measured on the run's in-memory quantized model
(which the run has just verified to be identical to its export) once it is done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.backends import Backend
from msquant.evaluate.data import file_sha256, read_eval_texts, tokenize_eval_texts
from msquant.evaluate.perplexity import check_seqlen
from msquant.evaluate.windows import DEFAULT_SEQLEN, measure_perplexity, sliding_windows
from msquant.report.run_report import EvaluationReport

__all__ = ["EvaluationData", "prepare_evaluation"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvaluationData:
    """An evaluation text file read and checked before a quantization run starts
    (``quant --eval_data``), measured on the run's in-memory model once the export is verified.

    :param path: the text file.
    :param sha256: sha256 of its bytes.
    :param texts: its samples.
    :param seqlen: window length in tokens.
    :param stride: distance between window starts.
    :param max_samples: evaluate at most this many windows (None: the whole text).
    """

    path: Path
    sha256: str
    texts: tuple[str, ...]
    seqlen: int
    stride: int
    max_samples: int | None

    def settings(self) -> dict[str, Any]:
        """What makes two evaluations comparable (and the file), keyed as in the report's
        ``evaluation``."""
        return {
            "data": str(self.path),
            "data_sha256": self.sha256,
            "seqlen": self.seqlen,
            "stride": self.stride,
            "max_samples": self.max_samples,
        }

    def check_model(self, config: Any, model_dir: str | Path) -> None:
        """Refuse a ``seqlen`` longer than the model's positions (from its config, no weights).

        :raises EvaluationError: naming the longest allowed value.
        """
        check_seqlen(self.seqlen, config, model_dir, flag="--eval_seqlen")

    def tokens(self, tokenizer: Any) -> torch.Tensor:
        """The token ids of the text, as ``msquant eval`` tokenizes it.

        :raises EvaluationError: when the text yields fewer than 2 tokens.
        """
        return tokenize_eval_texts(self.texts, tokenizer, self.path)

    def evaluate(
        self, model: nn.Module, input_ids: torch.Tensor, backend: Backend | None = None
    ) -> EvaluationReport:
        """The perplexity of ``model`` on the tokens, for the run report.

        With a ``backend`` the whole model is moved to its device for the forward passes and
        back to host memory afterwards (as ``msquant eval`` runs it: the model must fit).
        """
        if backend is not None:
            model = backend.to_device(model)
        try:
            logger.info(
                "evaluating the quantized model on %s (%d tokens)", self.path, input_ids.numel()
            )
            measured = measure_perplexity(
                model, input_ids, self.seqlen, self.stride, self.max_samples
            )
        finally:
            if backend is not None:
                backend.offload(model)
        logger.info(
            "perplexity %.4f on %s (%d tokens in %d window(s) of %d, stride %d) in %.1f s",
            measured.ppl,
            self.path,
            measured.tokens,
            measured.windows,
            self.seqlen,
            self.stride,
            measured.seconds,
        )
        return EvaluationReport(
            data=str(self.path),
            data_sha256=self.sha256,
            seqlen=self.seqlen,
            stride=self.stride,
            max_samples=self.max_samples,
            windows=measured.windows,
            tokens=measured.tokens,
            text_tokens=measured.text_tokens,
            nll=measured.nll,
            ppl=measured.ppl,
            seconds=measured.seconds,
        )


def prepare_evaluation(
    data_path: str | Path,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
) -> EvaluationData:
    """Check the window settings and read the text file, before any model is loaded.

    :raises EvaluationError: for settings out of range or a missing, unreadable or empty file.
    """
    sliding_windows(2, seqlen, stride, max_samples)  # validates the settings
    path = Path(data_path)
    texts = read_eval_texts(path)
    return EvaluationData(
        path=path,
        sha256=file_sha256(path),
        texts=tuple(texts),
        seqlen=seqlen,
        stride=seqlen if stride is None else stride,
        max_samples=max_samples,
    )
