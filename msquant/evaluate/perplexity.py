"""``msquant eval``: the perplexity of a float model or of an msquant export on a local text file,
or of both compared on the same tokens.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from msquant.backends import get_backend
from msquant.evaluate.data import read_eval_tokens
from msquant.evaluate.errors import EvaluationError
from msquant.evaluate.models import load_model_for_eval, max_positions, model_kind
from msquant.evaluate.results import PerplexityComparison, PerplexityResult
from msquant.evaluate.windows import DEFAULT_SEQLEN, measure_perplexity, sliding_windows
from msquant.load.model_folder import load_model_config, load_tokenizer

__all__ = ["evaluate_perplexity", "check_seqlen", "compare_perplexity"]

logger = logging.getLogger(__name__)


def evaluate_perplexity(
    model_dir: str | Path,
    data_path: str | Path,
    *,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
    tokenizer_dir: str | Path | None = None,
) -> PerplexityResult:
    """The perplexity of a float model folder or an msquant export on a local text file.

    :param model_dir: a Hugging Face model folder or one export folder (Ascend, MindIE naming,
        GPTQ, compressed-tensors); for a several-saver save path pass one of its subfolders.
    :param data_path: ``.txt`` (samples separated by blank lines), ``.jsonl`` or ``.json``.
    :param seqlen: window length in tokens (at most the model's ``max_position_embeddings``).
    :param stride: distance between window starts (default ``seqlen``: non-overlapping).
    :param max_samples: evaluate at most this many windows.
    :param tokenizer_dir: where the tokenizer is (default ``model_dir``; exports carry a copy).
    :raises MsquantInputError: (subclasses) for a missing folder or file, settings that do not
        fit the model, or text without tokens.
    """
    sliding_windows(2, seqlen, stride, max_samples)  # validate the settings before loading
    backend = get_backend(device)
    model_kind(model_dir)  # a clear message for a missing folder or a several-saver save path
    config = load_model_config(Path(model_dir), trust_remote_code)
    check_seqlen(seqlen, config, model_dir)
    tokenizer = load_tokenizer(Path(tokenizer_dir or model_dir), trust_remote_code)
    ids = read_eval_tokens(data_path, tokenizer)
    started = time.perf_counter()
    model, kind = load_model_for_eval(model_dir, trust_remote_code)
    model = backend.to_device(model)
    loaded = time.perf_counter()
    logger.info("evaluating %s [%s] on %s (%d tokens)", model_dir, kind, data_path, ids.numel())
    measured = measure_perplexity(model, ids, seqlen, stride, max_samples)
    return PerplexityResult(
        model=str(model_dir),
        kind=kind,
        data=str(data_path),
        ppl=measured.ppl,
        nll=measured.nll,
        tokens=measured.tokens,
        windows=measured.windows,
        text_tokens=measured.text_tokens,
        seqlen=seqlen,
        stride=seqlen if stride is None else stride,
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        seconds=measured.seconds,
        load_seconds=loaded - started,
    )


def check_seqlen(seqlen: int, config: Any, model_dir: str | Path, flag: str = "--seqlen") -> None:
    """Refuse windows longer than the model's positions; ``flag`` names the option to fix."""
    limit = max_positions(config)
    if limit is not None and seqlen > limit:
        raise EvaluationError(
            f"{flag.lstrip('-').replace('_', ' ')} {seqlen} is longer than the model's "
            f"max_position_embeddings ({limit}) in {model_dir}; pass {flag} {limit} or less"
        )


def compare_perplexity(
    original_dir: str | Path,
    quantized_dir: str | Path,
    data_path: str | Path,
    *,
    seqlen: int = DEFAULT_SEQLEN,
    stride: int | None = None,
    max_samples: int | None = None,
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> PerplexityComparison:
    """Perplexities of an original model and its export on the same tokens (both tokenized with
    the original's tokenizer), and the relative increase.

    :raises MsquantInputError: (subclasses) as :func:`evaluate_perplexity`, checked for both
        folders before either model is evaluated.
    """
    for folder in (original_dir, quantized_dir):
        model_kind(folder)
        check_seqlen(seqlen, load_model_config(Path(folder), trust_remote_code), folder)
    options: dict[str, Any] = dict(
        seqlen=seqlen,
        stride=stride,
        max_samples=max_samples,
        device=device,
        trust_remote_code=trust_remote_code,
        tokenizer_dir=original_dir,
    )
    original = evaluate_perplexity(original_dir, data_path, **options)
    quantized = evaluate_perplexity(quantized_dir, data_path, **options)
    return PerplexityComparison(original, quantized)
